"""Generation with transformers: student rollouts (sampled) and evaluation (greedy), left-padded prompts.

Every sequence tensor here is ``[B, P + R]``: a left-padded prompt block of width P, then R generated positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase


def position_ids_from_mask(attention_mask_B_T: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, as generation computes them (transformers 5 does not derive them itself)."""
    return (attention_mask_B_T.long().cumsum(-1) - 1).clamp(min=0)


@dataclass
class Rollout:
    sequences_B_T: torch.Tensor  # prompt (left-padded) + response tokens
    attention_mask_B_T: torch.Tensor  # 1 on real prompt tokens and on response tokens up to the first EOS
    response_mask_B_T: torch.Tensor  # 1 on response tokens up to and including the first EOS
    truncated_B: torch.Tensor  # True where the response hit the length cap without an EOS
    prompt_width: int

    @property
    def response_lengths_B(self) -> torch.Tensor:
        return self.response_mask_B_T.sum(-1)

    def loss_mask_B_T(self) -> torch.Tensor:
        """Mask over hidden positions ``0..T-2`` whose *next* token is a response token (the positions that predict it)."""
        return self.response_mask_B_T[:, 1:]


def response_mask(generated_B_R: torch.Tensor, eos_id: int) -> torch.Tensor:
    """1 up to and including the first EOS of each row, 0 after it (all 1 when no EOS: a truncated response)."""
    is_eos = (generated_B_R == eos_id).long()
    after_first_eos = (is_eos.cumsum(-1) - is_eos) > 0
    return (~after_first_eos).long()


@torch.no_grad()
def generate(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    prompts: list[str],
    max_new_tokens: int,
    greedy: bool = False,
    temperature: float = 1.0,
) -> Rollout:
    """Sample (temperature, no top-k/top-p truncation) or decode greedily one completion per prompt."""
    was_training = model.training
    model.eval()
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    kwargs = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    out_B_T = model.generate(
        input_ids=enc.input_ids,
        attention_mask=enc.attention_mask,
        max_new_tokens=max_new_tokens,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        **kwargs,
    )
    model.train(was_training)
    P = enc.input_ids.shape[1]
    resp_B_R = response_mask(out_B_T[:, P:], tok.eos_token_id)
    full_resp_B_T = torch.cat([torch.zeros_like(enc.attention_mask), resp_B_R], dim=1)
    attn_B_T = torch.cat([enc.attention_mask, resp_B_R], dim=1)
    truncated_B = ~(out_B_T[:, P:] == tok.eos_token_id).any(-1)
    return Rollout(out_B_T, attn_B_T, full_resp_B_T, truncated_B, P)


def decode_responses(tok: PreTrainedTokenizerBase, rollout: Rollout) -> list[str]:
    """Response text up to (not including) the first EOS."""
    out = []
    for seq_T, m_T in zip(rollout.sequences_B_T, rollout.response_mask_B_T):
        ids = seq_T[m_T.bool()].tolist()
        out.append(tok.decode(ids, skip_special_tokens=True))
    return out


def forward_hidden(model: PreTrainedModel, sequences_B_T: torch.Tensor, attention_mask_B_T: torch.Tensor) -> torch.Tensor:
    """Final hidden states ``[B, T, H]`` of a causal LM's decoder (no logits: the head is applied chunk by chunk)."""
    out = model.get_decoder()(
        input_ids=sequences_B_T,
        attention_mask=attention_mask_B_T,
        position_ids=position_ids_from_mask(attention_mask_B_T),
        use_cache=False,
    )
    return out.last_hidden_state
