"""Rendering a route's rows (tasks/specs/render.py): the tokenizer's own chat template with the route's or the row's system
prompt, a format string for base models, a refusal when a chat route meets a tokenizer without a template, and the
context-length check."""

import pytest

from tasks.specs.render import RenderError, length_problems, render_prompts
from tasks.specs.spec import parse_spec
from tasks.world.tokenizer import build_char_tokenizer

TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }};{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def route(**render):
    spec = parse_spec({"routes": [{"name": "r", "data": {"source": "x.jsonl"}, "render": render,
                                   "generate": {"max_new_tokens": 8}}]})
    return spec.routes[0]


@pytest.fixture()
def chat_tok():
    tok = build_char_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def test_chat_rendering_uses_the_tokenizer_template_and_the_right_system_prompt(chat_tok):
    rows = [{"prompt": "2+2?", "system": ""}, {"prompt": "3+3?", "system": "be brief"}]
    assert render_prompts(route(kind="chat", system="think"), rows, chat_tok) == [
        "<system>think;<user>2+2?;<assistant>", "<system>be brief;<user>3+3?;<assistant>"]
    assert render_prompts(route(kind="chat"), rows[:1], chat_tok) == ["<user>2+2?;<assistant>"]


def test_format_rendering_fills_prompt_system_and_context():
    r = route(kind="format", template="[{system}] {prompt} ({context}) =", system="low")
    rows = [{"prompt": "abc", "context": "hint"}, {"prompt": "de", "system": "high"}]
    assert render_prompts(r, rows, build_char_tokenizer()) == ["[low] abc (hint) =", "[high] de () ="]


def test_a_chat_route_with_a_tokenizer_without_a_template_is_refused():
    with pytest.raises(RenderError, match="has none; use render.kind format"):
        render_prompts(route(kind="chat"), [{"prompt": "x"}], build_char_tokenizer())


def test_prompts_longer_than_the_context_are_named_by_row(chat_tok):
    r = route(kind="format")
    prompts = ["a" * n for n in (3, 20, 4, 30, 25, 26, 27, 28, 29)]
    found = length_problems(r, prompts, chat_tok, context=24, file="s.yaml", limit=3)
    assert [str(p) for p in found] == [
        "s.yaml: routes[r].data: row 2: a 20-token prompt plus max_new_tokens 8 exceeds the model's 24-token context",
        "s.yaml: routes[r].data: row 4: a 30-token prompt plus max_new_tokens 8 exceeds the model's 24-token context",
        "s.yaml: routes[r].data: row 5: a 25-token prompt plus max_new_tokens 8 exceeds the model's 24-token context",
        "s.yaml: routes[r].data: ... and 4 more rows too long"]
    assert length_problems(r, ["a" * 16], chat_tok, context=24, file="s.yaml") == []  # 16 + 8 fits exactly
    assert "leave no room" in str(length_problems(r, ["a"], chat_tok, context=8, file="s.yaml")[0])
