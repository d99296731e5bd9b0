"""Model creation, loading and saving: every model is a transformers causal LM addressed by a local path or hub id."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from tasks.common.adapters import base_of
from tasks.specs.tokenizer import remote_code_refusal

hf_logging.disable_progress_bar()  # one "Loading weights" bar per teacher load drowns the training progress bars

# Honour OMP_NUM_THREADS even when torch was imported before tasks/__init__ set it (tiny models: 1 thread is fastest).
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

ARCHITECTURES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config"}


def create_model(
    tok: PreTrainedTokenizerBase,
    arch: str = "llama",
    hidden_size: int = 128,
    num_layers: int = 3,
    num_heads: int = 4,
    intermediate_size: int = 512,
    max_positions: int = 128,
    seed: int = 0,
) -> PreTrainedModel:
    """A fresh decoder-only model from a config (untied embeddings, so weight reloads stay exact)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch {arch!r} is not one of {sorted(ARCHITECTURES)}")
    config = AutoConfig.for_model(
        arch,
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    return model


def load_model(uri: str | Path, trust_remote_code: bool = False, dtype: torch.dtype = torch.float32,
               base: str | None = None) -> PreTrainedModel:
    """Load a causal LM by local path or hub id, safetensors weights only; a LoRA adapter folder (peft's format)
    loads as its base with the adapter merged in. A folder whose config names its own code
    (``auto_map``) is refused unless ``trust_remote_code`` is granted
    (:func:`tasks.specs.tokenizer.remote_code_refusal`). ``base``: the base an adapter folder loads onto, where its
    registry record names one (:func:`tasks.common.adapters.base_of`)."""
    base = base_of(uri, base)
    if base is not None:  # a LoRA adapter folder: its base with the adapter merged in (what scores and samples)
        from peft import PeftModel

        return PeftModel.from_pretrained(load_model(base, trust_remote_code, dtype), str(uri)).merge_and_unload()
    remote_code_refusal(uri, ("config.json",), trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(
        str(uri), dtype=dtype, use_safetensors=True, trust_remote_code=trust_remote_code
    )
    return model


def model_config(uri: str | Path, trust_remote_code: bool = False, base: str | None = None):
    """The transformers config of a checkpoint, or of an adapter folder's base (``base`` where named)."""
    return AutoConfig.from_pretrained(base_of(uri, base) or str(uri), trust_remote_code=trust_remote_code)


def save_model(
    model: PreTrainedModel, tok: PreTrainedTokenizerBase, out_dir: str | Path, state_dict: dict | None = None
) -> Path:
    """Save weights (safetensors) and tokenizer side by side so the folder is a complete checkpoint. ``state_dict``
    (a sharded model's gathered full weights) replaces the model's own."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True, state_dict=state_dict)
    tok.save_pretrained(out)
    return out


def checkpoint_fingerprint(path: str | Path) -> str:
    """Hash of a checkpoint folder's weights and config: changes whenever the model does."""
    h = hashlib.sha256()
    root = Path(path)
    files = sorted(p for p in root.glob("*") if p.suffix in {".safetensors", ".json"} and p.is_file())
    if not files:
        raise FileNotFoundError(f"no checkpoint files (*.safetensors, *.json) in {root}")
    for p in files:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return "sha256:" + h.hexdigest()[:16]


def base_problems(uri: str | Path, base_model: str, base_fingerprint: str = "") -> list[str]:
    """A teacher's named base (its registry record's ``base_model``) against its checkpoint, read before any weight
    loads: a base named for a full checkpoint (it is not a LoRA adapter folder), a local base that is not there, a
    local base whose weights changed since registration (``base_fingerprint``). [] when it holds or none is named;
    a hub id is taken as named (no weights here to compare)."""
    if not base_model:
        return []
    try:
        named = base_of(uri)
    except ValueError:  # an adapter folder whose config names no base: the record's base is the one to use
        named = base_model
    if named is None:
        return [f"base_model {base_model!r} is named, but {uri} is a full checkpoint (no adapter_config.json): "
                "expected base_model empty, or the LoRA adapter folder as model_uri"]
    local = Path(base_model).expanduser()
    if not local.exists():
        if local.is_absolute() or base_model.startswith((".", "~")):
            return [f"base_model {base_model}: no checkpoint folder there; expected the base the adapter was "
                    "trained on"]
        return []
    if base_fingerprint and (now := checkpoint_fingerprint(local)) != base_fingerprint:
        return [f"base_model {base_model} has weights {now}, registered with {base_fingerprint}: the base changed "
                "since the adapter was registered, and the adapter's deltas apply only to the weights it was "
                "trained on; re-register it against its base"]
    return []


def num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
