"""From a route's row to the text a model sees, as its spec's ``render`` says: chat messages through the tokenizer's
own chat template (the route's system prompt, or the row's, first), or a plain format string for base models. And
the length check a spec gets before any training: a prompt plus the route's ``max_new_tokens`` must fit the model's
context.

    from tasks.specs.render import render_prompts, length_problems
    prompts = render_prompts(route, rows["train"], tok)                    # list[str], one per row
    problems = length_problems(route, prompts, tok, context=2048, file="routes.yaml")
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from tasks.common.problems import Problem
from tasks.specs.spec import CONTEXT_TEMPLATE, RouteSpec, check_context_template


class RenderError(ValueError):
    """A route whose rows cannot be rendered with this tokenizer (e.g. ``kind: chat`` and no chat template)."""


def messages(route: RouteSpec, row: Mapping[str, Any]) -> list[dict[str, str]]:
    """The chat messages of one row: the system prompt (the row's, else the route's), then the user's prompt. With
    neither there is no system message at all, and what the model sees is whatever its chat template does then: many
    templates insert a default system prompt of their own (SmolLM2's: "You are a helpful AI assistant named SmolLM,
    trained by Hugging Face"), which the prompts then carry. A route that wants none must say so in its template's
    terms, not by leaving ``render.system`` empty."""
    system = str(row.get("system") or route.render.system)
    return ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": str(row["prompt"])}]


@dataclass(frozen=True)
class RowText:
    """What a route rendered for one row, so that a teacher can render its own input instead of reading the
    student's: the route, the student's prompt text as rendered, the chat ``messages`` it came from (system first,
    if any; None for a ``render.kind: format`` route, whose prompt text is the input for every model) and the row's
    ``context`` column (privileged context the student never sees; '' none). Where the student's response starts and
    ends in a rollout is the rollout's (:meth:`tasks.modeling.rollout.Rollout.response_span`)."""

    route: str
    prompt: str
    messages: tuple[tuple[tuple[str, str], ...], ...] | None = None
    context: str = ""

    @classmethod
    def of(cls, route: str, prompt: str, chat: Sequence[Mapping[str, str]] | None = None,
           context: str = "") -> "RowText":
        """From chat messages as ``apply_chat_template`` takes them (the inverse of :attr:`chat`)."""
        return cls(route, prompt, None if chat is None else tuple(tuple(sorted(m.items())) for m in chat), context)

    @property
    def chat(self) -> list[dict[str, str]] | None:
        """:attr:`messages` as ``apply_chat_template`` takes them (a list of role/content dicts)."""
        return None if self.messages is None else [dict(m) for m in self.messages]

    def with_context(self, template: str = "") -> "RowText":
        """This row as a teacher with privileged context reads it: the user's turn (a format route: the prompt text)
        rewritten as ``template`` over ``{context}`` (this row's :attr:`context`) and ``{prompt}`` (the turn itself;
        default :data:`CONTEXT_TEMPLATE`). The student never reads this text. A row without context: ValueError."""
        if not self.context.strip():
            raise ValueError(f"route {self.route!r}: a row has no context for a teacher that reads it (prompt "
                             f"{self.prompt[:60]!r}); give the route data.context_column or data.context_function")
        fill = check_context_template(template or CONTEXT_TEMPLATE).format
        if self.messages is None:
            return RowText(self.route, fill(context=self.context, prompt=self.prompt), None, self.context)
        chat = self.chat
        last = max(i for i, m in enumerate(chat) if m.get("role") == "user")
        chat[last] = {**chat[last], "content": fill(context=self.context, prompt=chat[last]["content"])}
        return RowText.of(self.route, self.prompt, chat, self.context)

    def render(self, tok: PreTrainedTokenizerBase) -> str:
        """This row's prompt in ``tok``'s own terms: its chat template over :attr:`messages` (with the generation
        prompt), or the prompt text itself for a format route. A chat row and a tokenizer without a chat template:
        :class:`RenderError`."""
        if self.messages is None:
            return self.prompt
        if not getattr(tok, "chat_template", None):
            raise RenderError(f"route {self.route!r} renders chat messages, and tokenizer "
                              f"{getattr(tok, 'name_or_path', '')!r} has no chat template to render them with")
        return tok.apply_chat_template(self.chat, tokenize=False, add_generation_prompt=True)


def row_texts(route: RouteSpec, rows: Sequence[Mapping[str, Any]] | Any, prompts: Sequence[str]) -> list[RowText]:
    """A :class:`RowText` for each row of ``route`` (its rendered ``prompts`` beside), as :func:`render_prompts`
    rendered them."""
    chat = route.render.kind == "chat"
    return [RowText.of(route.name, p, messages(route, r) if chat else None, str(r.get("context") or ""))
            for r, p in zip(list(rows), prompts)]


def render_prompts(route: RouteSpec, rows: Sequence[Mapping[str, Any]] | Any,
                   tok: PreTrainedTokenizerBase) -> list[str]:
    """The prompt text of every row (a list of mappings or a ``datasets.Dataset``), ready to be tokenized without
    special tokens added (a chat template writes its own)."""
    rows = list(rows)
    if route.render.kind == "format":
        return [route.render.template.format(prompt=r["prompt"], system=r.get("system") or route.render.system,
                                             context=r.get("context") or "") for r in rows]
    if not getattr(tok, "chat_template", None):
        raise RenderError(f"route {route.name!r} renders through the tokenizer's chat template (render.kind chat), "
                          f"and tokenizer {getattr(tok, 'name_or_path', '')!r} has none; use render.kind format "
                          "with a template, or a tokenizer that has a chat template")
    return [tok.apply_chat_template(messages(route, r), tokenize=False, add_generation_prompt=True) for r in rows]


def length_problems(route: RouteSpec, prompts: Sequence[str], tok: PreTrainedTokenizerBase, context: int,
                    file: str, limit: int = 5) -> list[Problem]:
    """Rows whose prompt tokens plus the route's ``generate.max_new_tokens`` exceed ``context`` (the model's
    positions): each named by its row, at most ``limit`` listed and the rest counted."""
    lengths = [len(ids) for ids in tok(list(prompts), add_special_tokens=False)["input_ids"]]
    cap = route.generate.max_new_tokens
    field = f"routes[{route.name}]"
    if cap >= context:
        return [Problem(file, f"{field}.generate.max_new_tokens", f"{cap} new tokens leave no room for a prompt in "
                        f"the model's {context}-token context")]
    too_long = [(i, n) for i, n in enumerate(lengths) if n + cap > context]
    problems = [Problem(file, f"{field}.data", f"row {i + 1}: a {n}-token prompt plus max_new_tokens {cap} exceeds "
                        f"the model's {context}-token context") for i, n in too_long[:limit]]
    if len(too_long) > limit:
        problems.append(Problem(file, f"{field}.data", f"... and {len(too_long) - limit} more rows too long"))
    return problems


def route_messages(spec: str | Mapping[str, Any], route: str) -> list[dict[str, str]] | None:
    """A chat route's messages in the shape its rows render (its system prompt, then a user turn), for the chat
    template checks at registration; None for a route that renders a format string."""
    from tasks.specs.spec import read_spec

    spec_route = read_spec(spec).route(route)
    return messages(spec_route, {"prompt": "1 + 1"}) if spec_route.render.kind == "chat" else None
