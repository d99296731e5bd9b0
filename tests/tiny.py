"""A tiny random Llama over a real tokenizer (2 layers, width 32): the model of the tests that need a real
tokenizer's vocabulary and chat template but no training worth the name."""

import torch


def tiny_llama(tok, seed: int, positions: int = 2048):
    """A fresh ``LlamaForCausalLM`` over ``tok``'s vocabulary (its BOS / EOS / pad ids), seeded by ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=positions, tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
