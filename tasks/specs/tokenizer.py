"""Tokenizers: loading, saving and fingerprinting any Hugging Face tokenizer (a checkpoint asking for its own code is
refused unless granted: :func:`remote_code_refusal`), the checks that a teacher's tokenizer can score the student's
tokens, and character-level tokenizers (:func:`char_tokenizer`: one token per character, plus
``<pad> <bos> <eos> <unk>`` and optional special tags) saved as a real ``PreTrainedTokenizerFast``. They save
with ``save_pretrained`` and load back with ``AutoTokenizer.from_pretrained`` like any hub tokenizer, so the rest of
the code never knows it is a toy. The built-in world's own is :func:`tasks.world.tokenizer.build_char_tokenizer`.
"""

from __future__ import annotations

import hashlib
import json
from functools import cache
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from tasks.common.adapters import tokenizer_source
from tasks.common.log import say
from tasks.common.problems import UserError

SPECIALS = {"pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>"}


# A ChatML-style template for character tokenizers built from a spec's data (one token per character, so the role
# names are spelled out; the two markers are single special tokens).
CHAT_START, CHAT_END = "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}" + CHAT_START + "{{ m['role'] }}\n{{ m['content'] }}" + CHAT_END + "\n{% endfor %}"
    "{% if add_generation_prompt %}" + CHAT_START + "assistant\n{% endif %}"
)


def char_tokenizer(chars: str, tags: list[str] = (), chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """One token per character of ``chars`` (sorted, deduplicated, in first-seen order), specials first (ids 0..3),
    then ``tags`` (special tokens, each one id). With ``chat_template`` the chat markers are special tokens too and
    ``<|im_end|>`` is the EOS, as in ChatML models."""
    specials = dict(SPECIALS)
    tags = list(tags)
    if chat_template:
        specials["eos_token"] = CHAT_END
        tags = [CHAT_START, *tags]
    vocab_list = list(dict.fromkeys([*specials.values(), *tags, *chars]))
    vocab = {tok: i for i, tok in enumerate(vocab_list)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIALS["unk_token"]))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        additional_special_tokens=tags,
        clean_up_tokenization_spaces=False,
        padding_side="left",
        **specials,
    )
    if chat_template:
        tok.chat_template = chat_template
    return tok


def save_tokenizer(tok: PreTrainedTokenizerBase, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out)
    return out


class RemoteCodeRefused(UserError, ValueError):
    """A checkpoint folder whose config names its own Python code (``auto_map``), and no grant to run it."""


def remote_code_refusal(uri: str | Path, files: tuple[str, ...], trust_remote_code: bool) -> None:
    """Raise :class:`RemoteCodeRefused` when a local folder's ``files`` (``config.json``, ``tokenizer_config.json``)
    name the checkpoint's own code (``auto_map``) and ``trust_remote_code`` is not granted. Without this a known
    ``model_type`` with an ``auto_map`` loads silently as the built-in class, which is not the model its author
    meant; a hub id is left to transformers, which refuses unknown code itself."""
    folder = Path(uri).expanduser()
    if trust_remote_code or not folder.is_dir():
        return
    for name in files:
        try:
            auto_map = json.loads((folder / name).read_text()).get("auto_map")
        except (OSError, ValueError, AttributeError):
            continue  # missing or unreadable: the load itself says so
        if auto_map:
            raise RemoteCodeRefused(
                f"{folder / name} names the checkpoint's own Python code (auto_map: {sorted(auto_map)}) and "
                "trust_remote_code is not granted: refused, nothing of it was run. Grant it only for code you "
                "trust (a teacher: trust_remote_code: true in its registry entry, `python -m teachers register "
                "... --trust_remote_code`)"
            )


def load_tokenizer(uri: str | Path, trust_remote_code: bool = False, base: str | None = None) -> PreTrainedTokenizerBase:
    """Load any tokenizer by local path or hub id (the same call a GPU user makes for a real checkpoint), left
    padding. A tokenizer without a pad token (most base checkpoints) pads with its EOS, and says so: batched
    generation needs one, and padding is masked out everywhere, so which id fills it does not matter. ``base``: the
    base an adapter folder applies to, where its registry record names one (:func:`tasks.common.adapters.base_of`)."""
    uri = tokenizer_source(uri, base)  # an adapter folder without tokenizer files: its base's (``base``: named)
    remote_code_refusal(uri, ("tokenizer_config.json",), trust_remote_code)
    tok = AutoTokenizer.from_pretrained(str(uri), trust_remote_code=trust_remote_code)
    tok.padding_side = "left"
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
        _say_once(f"tokenizer {uri} has no pad token: padding with its EOS {tok.eos_token!r} (id {tok.eos_token_id})")
    return tok


@cache
def _say_once(message: str) -> None:
    """:func:`tasks.common.log.say`, once per process for each message (a merge loads the same tokenizer often)."""
    say(message)


def tokenizer_fingerprint(tok: PreTrainedTokenizerBase) -> str:
    """A stable hash of what must match between teacher and student: vocab, special tokens and their ids."""
    payload = {
        "vocab": sorted(tok.get_vocab().items()),
        "special": sorted(tok.all_special_tokens),
        "ids": [tok.pad_token_id, tok.bos_token_id, tok.eos_token_id],
    }
    return "sha256:" + hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def first_differing_ids(student: dict[str, int], teacher: dict[str, int], limit: int = 3) -> list[str]:
    """The first ``limit`` ids at which two vocabularies (token -> id) hold different tokens, each as
    ``id N: student 'a' vs teacher 'b'`` (``None``: no token there)."""
    s_at, t_at = {i: t for t, i in student.items()}, {i: t for t, i in teacher.items()}
    out = []
    for i in sorted(set(s_at) | set(t_at)):
        if s_at.get(i) != t_at.get(i):
            out.append(f"id {i}: student {s_at.get(i)!r} vs teacher {t_at.get(i)!r}")
            if len(out) == limit:
                break
    return out


def compatibility_problems(student: PreTrainedTokenizerBase, teacher: PreTrainedTokenizerBase,
                           messages: list[dict[str, Any]] | None = None) -> list[str]:
    """Everything that would make a teacher's log-probs meaningless on the student's tokens; [] when compatible: the
    vocabularies (named by their first differing ids), the special tokens, and with ``messages`` (a route's first
    prompt as chat messages: the route renders chat) the teacher's own chat template, which it must have, rendering
    them as the student's does (the teacher scores the student's rendering; one it was not tuned on is off its
    distribution)."""
    problems: list[str] = []
    sv, tv = student.get_vocab(), teacher.get_vocab()
    if sv != tv:
        only_s = sorted(set(sv) - set(tv))[:8]
        only_t = sorted(set(tv) - set(sv))[:8]
        moved = sorted(k for k in set(sv) & set(tv) if sv[k] != tv[k])[:8]
        problems.append(
            f"vocabularies differ (student {len(sv)} tokens, teacher {len(tv)}; first differing ids: "
            f"{'; '.join(first_differing_ids(sv, tv))}; only in student: {only_s}, only in teacher: {only_t}, "
            f"different ids: {moved})"
        )
    for attr in ("eos_token", "bos_token", "pad_token"):
        s, t = getattr(student, attr), getattr(teacher, attr)
        s_id, t_id = getattr(student, attr + "_id"), getattr(teacher, attr + "_id")
        if (s, s_id) != (t, t_id):
            problems.append(f"{attr} differs: student {s!r} (id {s_id}) vs teacher {t!r} (id {t_id})")
    s_extra, t_extra = sorted(student.all_special_tokens), sorted(teacher.all_special_tokens)
    if s_extra != t_extra:
        problems.append(f"special tokens differ: student {s_extra} vs teacher {t_extra}")
    s_template, t_template = getattr(student, "chat_template", None), getattr(teacher, "chat_template", None)
    if messages and not t_template:
        problems.append("the route renders chat messages and the teacher's tokenizer has no chat template (it would "
                        "score prompts in a template it does not know); expected the student's chat template saved "
                        "with the teacher")
    elif messages and t_template != s_template:
        problems += chat_template_problems(student, teacher, messages)
    return problems


def chat_template_problems(student: PreTrainedTokenizerBase, teacher: PreTrainedTokenizerBase,
                           messages: list[dict[str, Any]]) -> list[str]:
    """The teacher's chat template must render ``messages`` (with the generation prompt) exactly as the student's:
    else a problem quoting both renderings from their first differing character."""
    def render(tok: PreTrainedTokenizerBase) -> str:
        if not getattr(tok, "chat_template", None):
            return "(no chat template)"
        try:
            return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # a template that raises on these messages renders nothing
            return f"(the chat template raises {type(e).__name__}: {e})"

    s_text, t_text = render(student), render(teacher)
    if s_text == t_text:
        return []
    at = next((i for i, (a, b) in enumerate(zip(s_text, t_text)) if a != b), min(len(s_text), len(t_text)))
    start = max(0, at - 20)  # a little of what they share, for context
    return [f"chat templates render a route's first prompt differently from character {at}: student "
            f"{s_text[start:at + 40]!r} vs teacher {t_text[start:at + 40]!r}"]
