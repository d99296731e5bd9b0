"""The built-in world's tokenizer: one token per character of :data:`tasks.world.domains.CHARSET`, plus
``<pad> <bos> <eos> <unk>`` and one special token per domain and per budget (the route tags)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

from tasks.specs.tokenizer import char_tokenizer
from tasks.world.domains import BUDGETS, CHARSET, DOMAINS


def route_tag_tokens() -> list[str]:
    return [f"<{d}>" for d in DOMAINS] + [f"<{b}>" for b in BUDGETS]


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """The built-in world's tokenizer: specials first (ids 0..3), then route tags, then characters."""
    return char_tokenizer(CHARSET, route_tag_tokens())
