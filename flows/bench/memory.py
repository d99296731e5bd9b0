"""Benchmark: peak memory of the chunked full-vocabulary divergence against the naive path, same inputs, one run.

The naive path materialises both models' ``[B, T, V]`` fp32 logits (and their log-softmaxes and gradients); the
chunked path (:func:`tasks.objectives.losses.chunked_objective`) computes ``chunk_size`` positions at a time and recomputes each
chunk's logits in the backward pass. Each path runs forward + backward in its own fresh process, so its peak RSS
above the inputs is its own. Printed: both values and gradients' largest difference, each peak, and the ratio.

Run:  python -m flows.bench.memory                                   # V = 32k, T = 2k, H = 512, B = 1
      python -m flows.bench.memory --vocab 32768 --seq 2048 --hidden 512 --chunk_size 64 --loss reverse_kl
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import tempfile

import torch
from pydantic import Field, field_validator

from tasks.bench.helpers import peak_rss_mb, reset_peak_rss
from tasks.config import _Config
from tasks.objectives.losses import LOSSES, LossName, Objective, chunked_objective, token_divergence
from tasks.common.table import format_table


class BenchMemoryConfig(_Config):
    """Shapes of the divergence benchmark."""

    vocab: int = Field(32768, ge=2, description="Vocabulary size V.")
    seq: int = Field(2048, ge=1, description="Sequence positions T.")
    hidden: int = Field(512, ge=1, description="Hidden width H of both models.")
    batch: int = Field(1, ge=1, description="Sequences B.")
    chunk_size: int = Field(64, ge=1, description="Positions per chunk of the chunked path.")
    loss: LossName = Field("reverse_kl", description="Divergence (any full-distribution loss of the menu).")
    seed: int = Field(0, ge=0)

    @field_validator("loss")
    @classmethod
    def _full_distribution(cls, v: str) -> str:
        # Both paths compare full [V] distributions; these two losses use one log-prob per token and a target.
        if v in ("sampled_token", "sft"):
            raise ValueError(f"loss {v!r} uses one log-prob per token, not the full distributions this benchmark "
                             f"compares: pick one of {[x for x in LOSSES if x not in ('sampled_token', 'sft')]}")
        return v


def _inputs(cfg: BenchMemoryConfig):
    gen = torch.Generator().manual_seed(cfg.seed)
    hs_B_T_H = torch.randn(cfg.batch, cfg.seq, cfg.hidden, generator=gen).requires_grad_(True)
    ht_B_T_H = torch.randn(cfg.batch, cfg.seq, cfg.hidden, generator=gen)
    student_head = torch.nn.Linear(cfg.hidden, cfg.vocab, bias=False)
    teacher_head = torch.nn.Linear(cfg.hidden, cfg.vocab, bias=False)
    with torch.no_grad():
        student_head.weight.copy_(torch.randn(cfg.vocab, cfg.hidden, generator=gen) * cfg.hidden ** -0.5)
        teacher_head.weight.copy_(torch.randn(cfg.vocab, cfg.hidden, generator=gen) * cfg.hidden ** -0.5)
    teacher_head.requires_grad_(False)
    mask_B_T = torch.ones(cfg.batch, cfg.seq)
    return hs_B_T_H, ht_B_T_H, student_head, teacher_head, mask_B_T


def _run(cfg_json: str, path: str, out_file: str) -> None:
    """One path, forward + backward, in this (fresh) process; writes the loss, the gradients of the student's hidden
    states and head, and the peak MB over the inputs to ``out_file``."""
    torch.set_num_threads(1)
    cfg = BenchMemoryConfig.model_validate_json(cfg_json)
    hs_B_T_H, ht_B_T_H, student_head, teacher_head, mask_B_T = _inputs(cfg)
    obj = Objective(loss=cfg.loss)
    reset_peak_rss()  # the inputs are resident; whatever start-up peaked at is not this path's
    base = peak_rss_mb()
    if path == "naive":
        zs_B_T_V = student_head(hs_B_T_H)
        with torch.no_grad():
            zt_B_T_V = teacher_head(ht_B_T_H)
        div_N = token_divergence(zs_B_T_V.flatten(0, 1), zt_B_T_V.flatten(0, 1), obj)
        loss = (div_N * mask_B_T.flatten()).sum() / mask_B_T.sum()
    else:
        loss = chunked_objective(hs_B_T_H, ht_B_T_H, student_head, teacher_head, mask_B_T, obj,
                                 chunk_size=cfg.chunk_size).loss
    loss.backward()
    peak = peak_rss_mb() - base
    torch.save({"loss": loss.detach(), "grad_h": hs_B_T_H.grad, "grad_w": student_head.weight.grad,
                "peak_mb": torch.tensor(peak)}, out_file)


def measure(cfg: BenchMemoryConfig, path: str):
    # glibc keeps freed heap pages resident, so peak RSS would count memory already released; with every allocation
    # over 64 KiB served by mmap (and returned on free) peak RSS follows the tensors actually alive.
    # Set for the spawned process only (it reads them at start), not left behind in this one's environment.
    malloc = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    saved = {k: os.environ.get(k) for k in malloc}
    with tempfile.TemporaryDirectory() as tmp:
        out_file = f"{tmp}/{path}.pt"
        p = mp.get_context("spawn").Process(target=_run, args=(cfg.model_dump_json(), path, out_file))
        os.environ.update({k: v for k, v in malloc.items() if saved[k] is None})
        try:
            p.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"the {path} path failed (exit code {p.exitcode})")
        r = torch.load(out_file, weights_only=True)
    return float(r["loss"]), r["grad_h"], r["grad_w"], float(r["peak_mb"])


def bench_memory(cfg: BenchMemoryConfig) -> dict:
    naive = measure(cfg, "naive")
    chunked = measure(cfg, "chunked")
    value_gap = abs(naive[0] - chunked[0])
    grad_gap = max(float((naive[1] - chunked[1]).abs().max()), float((naive[2] - chunked[2]).abs().max()))
    logits_mb = cfg.batch * cfg.seq * cfg.vocab * 4 / 2**20
    print(f"{cfg.loss}, V={cfg.vocab}, T={cfg.seq}, H={cfg.hidden}, B={cfg.batch}, chunk {cfg.chunk_size}; "
          f"one [B,T,V] fp32 tensor is {logits_mb:.0f} MB")
    print(format_table(["path", "loss", "peak MB above inputs"],
                       [["naive", naive[0], round(naive[3])], ["chunked", chunked[0], round(chunked[3])]]))
    ratio = chunked[3] / naive[3]
    print(f"chunked/naive peak memory {ratio:.3f}; |loss gap| {value_gap:.2e}; max |grad gap| {grad_gap:.2e}")
    return {"naive_mb": naive[3], "chunked_mb": chunked[3], "ratio": ratio, "value_gap": value_gap,
            "grad_gap": grad_gap}


def main(argv: list[str] | None = None) -> dict:
    from tasks.cli import parse_config

    return bench_memory(parse_config(argv, BenchMemoryConfig, __doc__))


if __name__ == "__main__":
    from tasks.cli import run_main

    sys.exit(run_main(main))
