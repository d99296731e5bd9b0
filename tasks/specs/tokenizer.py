"""Tokenizers: loading, saving and fingerprinting any Hugging Face tokenizer, the checks that a teacher's tokenizer
can score the student's tokens, and character-level tokenizers (:func:`char_tokenizer`: one token per character,
plus ``<pad> <bos> <eos> <unk>`` and optional special tags) saved as a real ``PreTrainedTokenizerFast``. They save
with ``save_pretrained`` and load back with ``AutoTokenizer.from_pretrained`` like any hub tokenizer, so the rest of
the code never knows it is a toy. The built-in world's own is :func:`tasks.world.tokenizer.build_char_tokenizer`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

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


def load_tokenizer(uri: str | Path, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Load any tokenizer by local path or hub id (the same call a GPU user makes for a real checkpoint)."""
    tok = AutoTokenizer.from_pretrained(str(uri), trust_remote_code=trust_remote_code)
    tok.padding_side = "left"
    return tok


def tokenizer_fingerprint(tok: PreTrainedTokenizerBase) -> str:
    """A stable hash of what must match between teacher and student: vocab, special tokens and their ids."""
    payload = {
        "vocab": sorted(tok.get_vocab().items()),
        "special": sorted(tok.all_special_tokens),
        "ids": [tok.pad_token_id, tok.bos_token_id, tok.eos_token_id],
    }
    return "sha256:" + hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def compatibility_problems(student: PreTrainedTokenizerBase, teacher: PreTrainedTokenizerBase) -> list[str]:
    """Everything that would make a teacher's log-probs meaningless on the student's tokens; [] when compatible."""
    problems: list[str] = []
    sv, tv = student.get_vocab(), teacher.get_vocab()
    if sv != tv:
        only_s = sorted(set(sv) - set(tv))[:8]
        only_t = sorted(set(tv) - set(sv))[:8]
        moved = sorted(k for k in set(sv) & set(tv) if sv[k] != tv[k])[:8]
        problems.append(
            f"vocabularies differ (student {len(sv)} tokens, teacher {len(tv)}; only in student: {only_s}, "
            f"only in teacher: {only_t}, different ids: {moved})"
        )
    for attr in ("eos_token", "bos_token", "pad_token"):
        s, t = getattr(student, attr), getattr(teacher, attr)
        s_id, t_id = getattr(student, attr + "_id"), getattr(teacher, attr + "_id")
        if (s, s_id) != (t, t_id):
            problems.append(f"{attr} differs: student {s!r} (id {s_id}) vs teacher {t!r} (id {t_id})")
    s_extra, t_extra = sorted(student.all_special_tokens), sorted(teacher.all_special_tokens)
    if s_extra != t_extra:
        problems.append(f"special tokens differ: student {s_extra} vs teacher {t_extra}")
    return problems
