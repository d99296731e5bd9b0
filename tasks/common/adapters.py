"""A LoRA adapter folder (peft's format: ``adapter_config.json`` + ``adapter_model.safetensors``) as a checkpoint:
it names the base it applies to, and every loader reads the base's config (and tokenizer, when the folder has none)
from there. Pure file reading, so that the tokenizer, model and preflight layers all see an adapter the same way."""

from __future__ import annotations

import json
from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_SUBFOLDER = "adapter"  # a LoRA-trained model's peft adapter, in this subfolder of its (merged) checkpoint
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def adapter_base(uri: str | Path) -> str | None:
    """The base a local adapter folder applies to (its ``base_model_name_or_path``), or None when ``uri`` is not an
    adapter folder (a full checkpoint, with its own ``config.json``, or a hub id). ValueError when the adapter names
    no base."""
    folder = Path(uri).expanduser()
    if not (folder / ADAPTER_CONFIG).is_file() or (folder / "config.json").is_file():
        return None
    base = json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{folder / ADAPTER_CONFIG} names no base_model_name_or_path; expected the base model the "
                         "adapter was trained on")
    return str(base)


def base_of(uri: str | Path, base: str | None = None) -> str | None:
    """The base an adapter folder loads onto: ``base`` where given (a registry record's ``base_model``, which may
    name a local copy of the hub id the adapter was saved against), else the one its config names; None for a full
    checkpoint."""
    named = adapter_base(uri)
    return None if named is None else (base or named)


def tokenizer_source(uri: str | Path, base: str | None = None) -> str:
    """Where ``uri``'s tokenizer lies: the folder itself, or an adapter's base (``base``, when its registry record
    names one, else the one its config names) when the adapter folder has none."""
    base = base_of(uri, base)
    if base and not any((Path(uri).expanduser() / f).is_file() for f in TOKENIZER_FILES):
        return base
    return str(uri)


def saved_adapter(uri: str | Path) -> Path | None:
    """The peft adapter a LoRA-trained checkpoint keeps beside its merged weights (``<uri>/adapter``), if any."""
    folder = Path(uri).expanduser() / ADAPTER_SUBFOLDER
    return folder if (folder / ADAPTER_CONFIG).is_file() else None
