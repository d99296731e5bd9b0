"""Builds ``tests/data/other-tokenizer``: a small tokenizer of *another family* than SmolLM2's, for the cross-tokenizer
teacher tests (run once; its output is committed, so the tests need no training).

It is shaped like Gemma's, the second model family the real measurement uses: SentencePiece-style BPE (spaces
normalised to ``▁``, no pre-tokenizer, so merges cross word boundaries and several digits merge into one token,
the X-Token paper's trap for a digit-splitting student), byte fallback (``<0x..>`` tokens for any byte), its own
specials (``<bos>``, ``<eos>``, ``<start_of_turn>``, ``<end_of_turn>``) and a Gemma-like chat template that folds the
system prompt into the first user turn and ends an assistant turn with ``<end_of_turn>``.

    python tests/data/make_other_tokenizer.py
"""

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, trainers
from transformers import PreTrainedTokenizerFast

OUT = Path(__file__).parent / "other-tokenizer"
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] + '\n\n' %}"
    "{% set rest = messages[1:] %}{% else %}{% set sys = '' %}{% set rest = messages %}{% endif %}"
    "{% for m in rest %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ sys if loop.first else '' }}{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def corpus() -> list[str]:
    words = ("the answer is reverse sort shift count list numbers word letters final only with each of and to in "
             "a an sum add plus minus equals what step result hello world model user system carry digit").split()
    lines = [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(400)]
    lines += [f"{a} + {b} = {a + b}" for a in range(0, 200, 3) for b in range(0, 120, 7)]
    lines += [f"The answer is {n}." for n in range(0, 1000, 3)]
    return lines


def main() -> None:
    backend = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=SPECIALS, show_progress=False)
    backend.train_from_iterator(corpus(), trainer)
    # Byte fallback needs the 256 <0xNN> tokens in the model's own vocabulary (as Gemma has them), not as specials.
    doc = json.loads(backend.to_str())
    vocab = doc["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    backend = Tokenizer.from_str(json.dumps(doc))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                  unk_token="<unk>", additional_special_tokens=["<start_of_turn>", "<end_of_turn>"],
                                  clean_up_tokenization_spaces=False, padding_side="left")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(OUT)
    print(f"{OUT}: {len(tok)} tokens")


if __name__ == "__main__":
    main()
