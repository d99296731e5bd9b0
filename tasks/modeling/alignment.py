"""Two tokenizers over one text: what each token stands for in bytes, where their boundaries meet, and the signal a
teacher of another tokenizer gives each of the student's tokens. Pure functions (no model), used by
:class:`tasks.modeling.aligned.AlignedTeacher`.

Every token stands for a byte string (:func:`token_bytes`: byte-level BPE's ``Ġ`` alphabet inverted, SentencePiece's
``▁`` as a space and ``<0xNN>`` byte-fallback tokens as that byte; special tokens stand for none). The student's
response and the teacher's tokenization of the same text then cover the same bytes, each token a byte interval,
and the signal for a student token covering bytes ``[a, b)`` is the teacher's log-probability of those bytes given
everything before them:

    log p_T(text[a:b] | text[:a]) = L(b) - L(a)

with ``L(x)`` the teacher's log-probability that its text starts with ``text[:x]``: the sum of its own tokens'
log-probs up to the teacher token ``w_i`` that ``x`` falls in, plus, when ``x`` cuts ``w_i`` inside, the log of
the teacher's mass on tokens whose bytes start with ``text[t_i:x]`` (:func:`prefix_ranges`: one range of the
teacher's vocabulary sorted by bytes). Where both ends are teacher boundaries this is the summed log-probs of the
teacher tokens between them (ULD / GOLD's many-to-one spans); where the student's token is exactly one teacher token
it is that token's log-prob; where the student splits a teacher token (a digit-splitting student under a teacher with
multi-digit numerals, the X-Token trap) the prefix masses still give each piece a signal instead of none. Each value
is <= 0 (a longer prefix has no more mass).

A student token is *one-to-one* when it is exactly one teacher token (same bytes, both ends boundaries): there the
teacher's whole next-token distribution, mapped onto the student's vocabulary by token bytes (:func:`vocab_map`),
serves the full-vocabulary and top-k objectives.
"""

from __future__ import annotations

import bisect
import json
import re
from dataclasses import dataclass
from functools import cache

from transformers import PreTrainedTokenizerBase

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable alphabet for the 256 bytes (``bytes_to_unicode``), inverted: character -> byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _byte_level(tok: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer spells bytes in GPT-2's alphabet (a ``ByteLevel`` decoder), else SentencePiece-style."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"tokenizer {getattr(tok, 'name_or_path', '')!r} is not a fast tokenizer; aligning two "
                         "tokenizers needs the tokenizers library's (tokenizer.json)")
    return "ByteLevel" in json.dumps(json.loads(backend.to_str()).get("decoder"))


def token_bytes(tok: PreTrainedTokenizerBase) -> list[bytes | None]:
    """What each id of ``tok`` (``len(tok)`` of them) stands for in bytes; None for a special token (an EOS, a
    chat marker), which stands for no text."""
    special = set(tok.all_special_ids)
    added = {i: t for i, t in tok.added_tokens_decoder.items()}
    special |= {i for i, t in added.items() if t.special}
    byte_level = _byte_level(tok)
    decoder = _byte_decoder()
    out: list[bytes | None] = []
    for i, piece in enumerate(tok.convert_ids_to_tokens(list(range(len(tok))))):
        if i in special or piece is None:
            out.append(None)
        elif i in added:
            out.append(added[i].content.encode())
        elif byte_level:
            out.append(bytes(decoder[c] for c in piece) if all(c in decoder for c in piece) else piece.encode())
        elif m := _BYTE_TOKEN.fullmatch(piece):
            out.append(bytes([int(m[1], 16)]))
        else:
            out.append(piece.replace("▁", " ").encode())
    return out


def same_bytes(teacher: list[bytes | None]) -> dict[bytes, list[int]]:
    """The byte strings that several teacher ids stand for, each with its ids (SentencePiece's byte-fallback
    ``<0x38>`` beside the piece ``8``; a normal token and an added one): one text, several tokens."""
    groups: dict[bytes, list[int]] = {}
    for i, b in enumerate(teacher):
        if b:
            groups.setdefault(b, []).append(i)
    return {b: ids for b, ids in groups.items() if len(ids) > 1}


def canonical_ids(tok: PreTrainedTokenizerBase, groups: dict[bytes, list[int]]) -> dict[bytes, int]:
    """For each byte string several ids of ``tok`` stand for, the one ``tok`` writes for that text on its own (the
    piece ``8``, not the byte-fallback ``<0x38>`` it never emits for it); the lowest id where it writes none of them."""
    out = {}
    for b, ids in groups.items():
        try:
            written = tok(b.decode("utf-8"), add_special_tokens=False)["input_ids"]
        except UnicodeDecodeError:
            written = []
        out[b] = written[0] if len(written) == 1 and written[0] in ids else min(ids)
    return out


def vocab_map(student: list[bytes | None], teacher: list[bytes | None],
              prefer: dict[bytes, int] | None = None) -> list[int]:
    """For each student id, the teacher id that stands for the same bytes (``prefer``'s, when several do: see
    :func:`canonical_ids`; else the lowest), -1 where the teacher has no such token (and for special tokens: the
    caller maps the stop tokens itself). One-to-one: a teacher id serves one student id at most (the lowest), so a
    mapped distribution never counts a token twice."""
    by_bytes: dict[bytes, int] = {}
    for i, b in enumerate(teacher):
        if b:
            by_bytes.setdefault(b, i)
    by_bytes.update(prefer or {})
    out, taken = [], set()
    for b in student:
        j = by_bytes.get(b, -1) if b else -1
        out.append(j if j not in taken else -1)
        taken.add(j)
    return out


@dataclass(frozen=True)
class SortedVocab:
    """A teacher's text tokens sorted by their bytes: the tokens whose bytes start with a prefix are one range."""

    ids: list[int]  # teacher ids in byte order
    keys: list[bytes]  # their bytes, sorted

    @classmethod
    def of(cls, teacher: list[bytes | None]) -> "SortedVocab":
        pairs = sorted((b, i) for i, b in enumerate(teacher) if b)
        return cls([i for _, i in pairs], [b for b, _ in pairs])

    def prefix_range(self, prefix: bytes) -> tuple[int, int]:
        """``[lo, hi)``: the positions in :attr:`ids` of the tokens whose bytes start with ``prefix``."""
        lo = bisect.bisect_left(self.keys, prefix)
        hi = bisect.bisect_right(self.keys, prefix, lo=lo, key=lambda k: k[:len(prefix)])
        return lo, hi


def boundaries(pieces: list[bytes]) -> list[int]:
    """Byte offsets where each piece ends: ``[len(p0), len(p0) + len(p1), ...]``."""
    out, x = [], 0
    for p in pieces:
        x += len(p)
        out.append(x)
    return out


@dataclass(frozen=True)
class Endpoint:
    """``L(x)`` for one byte offset ``x`` (module docstring): the log-probs of teacher tokens ``0..token-1`` summed,
    plus, with ``prefix``, the log of the teacher's mass at token ``token``'s position on tokens starting with
    ``prefix`` (``x`` cuts that teacher token inside)."""

    token: int
    prefix: bytes = b""


@dataclass(frozen=True)
class StudentToken:
    """The teacher's signal for one student token: ``L(end) - L(start)``; ``one_to_one`` is the teacher token it
    equals exactly (-1: none)."""

    start: Endpoint
    end: Endpoint
    one_to_one: int = -1


def endpoint(x: int, teacher_ends: list[int], teacher_pieces: list[bytes]) -> Endpoint:
    """``L(x)``'s recipe at byte offset ``x`` of a text the teacher tokenized into ``teacher_pieces`` (ending at
    ``teacher_ends``)."""
    i = bisect.bisect_left(teacher_ends, x)  # the first teacher token that ends at or after x
    start_i = teacher_ends[i - 1] if i else 0
    if x == start_i:
        return Endpoint(i)
    if i < len(teacher_ends) and x == teacher_ends[i]:
        return Endpoint(i + 1)
    return Endpoint(i, teacher_pieces[i][: x - start_i])


def align(student_pieces: list[bytes], teacher_pieces: list[bytes]) -> list[StudentToken | None]:
    """Each student token's signal recipe over the teacher's tokens of the same text; None for a student token that
    stands for no bytes (a special token inside a response). Both sides must cover the same bytes (else
    ValueError: the caller masks the row)."""
    if b"".join(student_pieces) != b"".join(teacher_pieces):
        raise ValueError("the two tokenizations do not cover the same bytes")
    s_ends, t_ends = boundaries(student_pieces), boundaries(teacher_pieces)
    out: list[StudentToken | None] = []
    a = 0
    for piece, b in zip(student_pieces, s_ends):
        if not piece:
            out.append(None)
            continue
        start, end = endpoint(a, t_ends, teacher_pieces), endpoint(b, t_ends, teacher_pieces)
        one = start.token if not start.prefix and not end.prefix and end.token == start.token + 1 else -1
        out.append(StudentToken(start, end, one))
        a = b
    return out


def decodable(data: bytes) -> tuple[str, int]:
    """The longest prefix of ``data`` that is whole UTF-8 text, and its length in bytes (a sampled response may end
    inside a multi-byte character, or hold a stray byte token): what a teacher can read of it."""
    try:
        return data.decode("utf-8"), len(data)
    except UnicodeDecodeError as e:  # everything before the first bad byte decodes
        return data[: e.start].decode("utf-8"), e.start


def turn_end_text(tok: PreTrainedTokenizerBase) -> str:
    """What the tokenizer's chat template writes right after an assistant message's content (ChatML's
    ``<|im_end|>``, Gemma's ``<end_of_turn>``), up to the line's end: the text that ends a turn in the model's
    own terms; '' without a chat template or when the template writes nothing there."""
    if not getattr(tok, "chat_template", None):
        return ""
    sentinel = "\x00OPD-END\x00"
    text = tok.apply_chat_template([{"role": "user", "content": "x"}, {"role": "assistant", "content": sentinel}],
                                   tokenize=False)
    after = text.split(sentinel, 1)[1] if sentinel in text else ""
    return after.split("\n", 1)[0]


def stop_id(tok: PreTrainedTokenizerBase) -> int:
    """The id that ends an assistant turn of ``tok``'s model: the first token of :func:`turn_end_text` when that is
    a special token, else the tokenizer's EOS."""
    end = turn_end_text(tok)
    if end:
        ids = tok(end, add_special_tokens=False)["input_ids"]
        if ids and ids[0] in set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}:
            return ids[0]
    return tok.eos_token_id


def digit_ids(tok: PreTrainedTokenizerBase) -> list[int]:
    """The ids of ``tok`` whose text holds a digit (the tokens the X-Token trap is about: a digit-splitting tokenizer
    under one with multi-digit numerals). Digits are reported apart in the aligned fraction."""
    return [i for i, b in enumerate(token_bytes(tok)) if b and any(48 <= c <= 57 for c in b)]


def aligned_problems(teacher_tok: PreTrainedTokenizerBase, messages: list[dict[str, str]] | None) -> list[str]:
    """What keeps a tokenizer from serving an aligned teacher: no fast tokenizer (its token bytes are read from
    tokenizer.json), or no chat template on a route that renders chat (``messages`` given)."""
    problems = []
    try:
        token_bytes(teacher_tok)
    except ValueError as e:
        problems.append(str(e))
    if messages and not getattr(teacher_tok, "chat_template", None):
        problems.append("the route renders chat messages and the teacher's tokenizer has no chat template to render "
                        "them in its own terms; expected a tokenizer with a chat template")
    return problems
