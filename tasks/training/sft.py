"""Supervised fine-tuning on gold completions: base pre-training on the mixed world and per-route specialists."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase, get_cosine_schedule_with_warmup

from tasks.config import LoRAFields, TrainConfig
from tasks.common.adapters import ADAPTER_SUBFOLDER
from tasks.evaluation.evaluate import derail
from tasks.modeling.device import autocast_for, model_device
from tasks.modeling.rollout import position_ids_from_mask


def with_lora(model: PreTrainedModel, cfg: LoRAFields):
    """``model`` wrapped in a fresh peft LoRA adapter of ``cfg.lora_rank`` on ``cfg.lora_targets`` (its own weights
    frozen), or ``model`` itself when ``lora_rank`` is 0 (``cfg``: a specialist's :class:`TrainConfig` or the merge's
    ``opd``). The adapter starts at zero (peft's B = 0), so the wrapped model computes exactly what the base does
    until it trains."""
    if not cfg.lora_rank:
        return model
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(cfg.seed)
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, target_modules=list(cfg.lora_targets),
                      task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def save_trained(model: PreTrainedModel, tok: PreTrainedTokenizerBase, out_dir, state_dict: dict | None = None):
    """Save a trained model as a complete checkpoint in ``out_dir`` (:func:`tasks.modeling.models.save_model`); a
    LoRA-wrapped one is saved merged into its base, with its adapter (peft's own format: adapter_config.json names
    the base) in ``out_dir/adapter``. Returns (the plain model, the folder)."""
    from tasks.modeling.models import save_model

    if hasattr(model, "merge_and_unload"):
        save_model(model, tok, Path(out_dir) / ADAPTER_SUBFOLDER)
        model = model.merge_and_unload()
    return model, save_model(model, tok, out_dir, state_dict)


@dataclass
class SFTBatch:
    input_ids_B_T: torch.Tensor
    attention_mask_B_T: torch.Tensor
    labels_B_T: torch.Tensor  # -100 on prompt and padding


def sft_batch(tok: PreTrainedTokenizerBase, prompts: list[str], completions: list[str]) -> SFTBatch:
    """Left-padded ``prompt + completion + EOS``; the loss covers the completion and its EOS only."""
    p_ids = tok(prompts, add_special_tokens=False)["input_ids"]
    c_ids = tok(completions, add_special_tokens=False)["input_ids"]
    seqs = [p + c + [tok.eos_token_id] for p, c in zip(p_ids, c_ids)]
    T = max(map(len, seqs))
    ids = torch.full((len(seqs), T), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    labels = torch.full((len(seqs), T), -100, dtype=torch.long)
    for i, (s, p) in enumerate(zip(seqs, p_ids)):
        ids[i, T - len(s):] = torch.tensor(s)
        mask[i, T - len(s):] = 1
        labels[i, T - len(s) + len(p):] = torch.tensor(s[len(p):])
    return SFTBatch(ids, mask, labels)


def sft_loss(model: PreTrainedModel, batch: SFTBatch) -> torch.Tensor:
    """The mean next-token cross-entropy of the batch's labelled tokens, on the model's device under its compute
    dtype (:func:`tasks.modeling.device.autocast_for`)."""
    device = model_device(model)
    mask_B_T = batch.attention_mask_B_T.to(device)
    with autocast_for(model):
        out = model(
            input_ids=batch.input_ids_B_T.to(device),
            attention_mask=mask_B_T,
            position_ids=position_ids_from_mask(mask_B_T),
            labels=batch.labels_B_T.to(device),
            use_cache=False,
        )
    return out.loss.float()


def make_optimizer(model: PreTrainedModel, lr: float, weight_decay: float, warmup: int, steps: int):
    """AdamW over the trainable parameters (all of them, or a LoRA adapter's) with linear warmup then cosine decay to
    0 (SFT and OPD alike)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.98))
    return opt, get_cosine_schedule_with_warmup(opt, warmup, steps)


def noisy_row(tok: PreTrainedTokenizerBase, prompt: str, completion: str, answer: str, rate: float,
              rng: random.Random) -> tuple[str, str]:
    """With probability ``rate``, ``(prompt + wrong prefix, gold rest)`` (:func:`derail`), else the row as it is."""
    if rng.random() >= rate:
        return prompt, completion
    out = derail(tok, completion, answer, rng)
    return (prompt, completion) if out is None else (prompt + out[0], out[1])


def train_sft(
    model: PreTrainedModel,
    tok: PreTrainedTokenizerBase,
    prompts: list[str],
    completions: list[str],
    cfg: TrainConfig,
    desc: str = "sft",
    log_every: int = 50,
    on_log=None,
    answers: list[str] | None = None,
) -> list[float]:
    """Train on (prompt, completion) pairs with AdamW; returns the loss of every step. Shows a progress bar. With
    ``cfg.recovery_noise`` (needs each row's final ``answers``) that share of the rows drawn is derailed afresh each
    time (:func:`tasks.evaluation.evaluate.derail`): the prompt gets the wrong prefix, the loss the gold rest."""
    if not prompts:
        raise ValueError(f"{desc}: no training rows")
    if cfg.recovery_noise > 0 and (answers is None or len(answers) != len(prompts)):
        raise ValueError(f"{desc}: recovery_noise needs each row's final answer, to find the trace before it")
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    opt, sched = make_optimizer(model, cfg.lr, cfg.weight_decay, cfg.warmup_steps, cfg.steps)
    model.train()
    losses: list[float] = []
    order: list[int] = []
    bar = tqdm(range(cfg.steps), desc=desc, mininterval=2.0, leave=True)
    for step in bar:
        if len(order) < cfg.batch_size:
            fresh = list(range(len(prompts)))
            rng.shuffle(fresh)
            order.extend(fresh)
        idx, order = order[: cfg.batch_size], order[cfg.batch_size:]
        rows = [(prompts[i], completions[i]) for i in idx]
        if cfg.recovery_noise > 0:
            rows = [noisy_row(tok, p, c, answers[i], cfg.recovery_noise, rng) for (p, c), i in zip(rows, idx)]
        loss = sft_loss(model, sft_batch(tok, [p for p, _ in rows], [c for _, c in rows]))
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"{desc}: loss is {loss.item()} at step {step}")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % log_every == 0 or step == cfg.steps - 1:
            bar.set_postfix(loss=f"{loss.item():.4f}", refresh=False)
            if on_log is not None:
                on_log(step, loss.item())
    model.eval()
    return losses
