"""Benchmark: where one OPD step's time goes (generation, teacher scoring, student update) at a few model sizes,
next to the ideal FLOP bound on this machine. Not a timed test: the numbers depend on the machine and its load.

Each shape gets an untrained student and an untrained teacher of the same shape (another seed), made with this
project's code, and runs ``warmup`` + ``steps`` plain on-policy steps (:func:`tasks.training.distill.opd_step`, reverse KL) on
the built-in world's prompts; the timed steps are averaged. The bound:

    FLOPs per token = 2 P_teacher + 6 P_student     (teacher forward; student forward + backward)
    ideal seconds   = tokens * FLOPs per token / peak FLOP/s

with P = all parameters, embeddings and output head included, tokens = the response tokens of the step (the ones
distilled), and peak = the best fp32 ``[n, n] @ [n, n]`` on this CPU at the same thread count, measured in the same run
(before and after the shapes). The bound leaves out generation's own forward (2 P_student per token, counted in the
``gen x`` column instead), the prompt positions and attention. Generation is memory/latency bound at these sizes:
one decode step per token for the whole batch, each a chain of small matmuls, so ``gen x`` is far above 1.

With ``--dtypes fp32,bf16`` each shape runs once per compute dtype, side by side (the student under autocast with
fp32 master weights, the teacher's weights in that dtype: :mod:`tasks.modeling.device`), and the ``vs fp32`` column
is each run's total over the first dtype's on the same shape.

Run:  python -m flows.bench.step              # shapes 64x2x2, 256x4x4, 512x6x8; batch 32, 32 new tokens
      python -m flows.bench.step --dtypes fp32,bf16 --shapes 128x3x4,576x8x9   # bf16 against fp32, one run
      python -m flows.bench.step --quick      # one tiny shape, one step (seconds)
      python -m flows.bench.step --shapes 128x3x4,1024x8x16 --batch_size 64 --threads 2

The table goes to stdout and to MLflow (experiment ``opd-bench``, run ``bench-step-...``).
"""

from __future__ import annotations

import sys

import torch
from typing import Literal

from pydantic import Field

from tasks.bench.helpers import BenchOPDConfig, matmul_flops, opd_steps, parse_bench_config, parse_shape, publish
from tasks.common.log import say
from tasks.config import DEVICE_HELP
from tasks.modeling.device import DeviceName, place_frozen, place_trained
from tasks.modeling.models import create_model, num_parameters
from tasks.world.tokenizer import build_char_tokenizer


class BenchStepConfig(BenchOPDConfig):
    """Shapes, batch and step counts of the step-time breakdown."""

    shapes: list[str] = Field(
        default_factory=lambda: ["64x2x2", "256x4x4", "512x6x8"],
        description="Model shapes HIDDENxLAYERSxHEADS (MLP 4x hidden); the teacher has the student's shape.",
    )
    batch_size: int = Field(32, ge=1, le=4096, description="Prompts per step.")
    matmul_n: int = Field(2048, ge=16, description="Side of the square fp32 matmul that measures peak FLOP/s.")
    dtypes: list[Literal["fp32", "bf16"]] = Field(
        default_factory=lambda: ["fp32"], min_length=1, description="Compute dtypes timed side by side on each shape "
        "(the student under autocast with fp32 master weights, the teacher's weights in it); the 'vs first' column "
        "is each one's step time over the first's.")
    device: DeviceName = Field("auto", description="Where student and teacher run. " + DEVICE_HELP)


def bench_step_config(profile: str = "default") -> BenchStepConfig:
    if profile == "quick":
        return BenchStepConfig(shapes=["64x2x2"], batch_size=4, max_new_tokens=8, steps=1, matmul_n=256)
    return BenchStepConfig()


def time_shape(cfg: BenchStepConfig, shape: str, dtype: str = "fp32") -> dict:
    """Mean seconds of each part of the timed steps, mean response tokens per step, and the parameter counts, with
    the student computing in ``dtype`` (fp32 master weights) and the teacher held in it."""
    tok = build_char_tokenizer()
    student = place_trained(create_model(tok, seed=cfg.seed, **parse_shape(shape).model_dump()), cfg.device, dtype)
    teacher = place_frozen(create_model(tok, seed=cfg.seed + 1, **parse_shape(shape).model_dump()), cfg.device,
                           dtype)
    step = opd_steps(cfg, student, teacher, tok)
    for i in range(cfg.warmup):
        step(i)
    timed = [step(i) for i in range(cfg.warmup, cfg.warmup + cfg.steps)]
    parts = {k: sum(s.seconds[k] for s in timed) / cfg.steps for k in ("generate", "teacher", "update")}
    return {"params": num_parameters(student), "teacher_params": num_parameters(teacher),
            "tokens": sum(s.tokens for s in timed) / cfg.steps, **parts}


HEADERS = ["shape", "dtype", "params", "tokens/step", "gen ms", "teacher ms", "update ms", "total ms", "vs first",
           "ideal ms", "measured/ideal", "gen x", "teacher x", "update x"]


def bench_step(cfg: BenchStepConfig) -> dict:
    torch.set_num_threads(cfg.threads)
    peak_before = matmul_flops(cfg.matmul_n)
    results = {}
    for shape in cfg.shapes:
        for dtype in cfg.dtypes:
            say(f"{shape} {dtype}: {cfg.warmup} warm-up + {cfg.steps} timed steps, batch {cfg.batch_size}, "
                f"up to {cfg.max_new_tokens} new tokens")
            results[shape, dtype] = time_shape(cfg, shape, dtype)
    peak_after = matmul_flops(cfg.matmul_n)
    peak = max(peak_before, peak_after)
    rows, metrics = [], {"peak_gflops": peak / 1e9}
    totals = {key: r["generate"] + r["teacher"] + r["update"] for key, r in results.items()}
    for (shape, dtype), r in results.items():
        Ps, Pt, n = r["params"], r["teacher_params"], r["tokens"]
        ideal = {"generate": n * 2 * Ps / peak, "teacher": n * 2 * Pt / peak, "update": n * 6 * Ps / peak}
        total = totals[shape, dtype]
        bound = ideal["teacher"] + ideal["update"]
        rows.append([shape, dtype, Ps, n, *(1e3 * r[k] for k in ("generate", "teacher", "update")), 1e3 * total,
                     total / totals[shape, cfg.dtypes[0]], 1e3 * bound, total / bound,
                     *(r[k] / ideal[k] for k in ("generate", "teacher", "update"))])
        # The first dtype keeps the metric names runs before --dtypes logged; others are suffixed with theirs.
        key = shape if dtype == cfg.dtypes[0] else f"{shape}-{dtype}"
        metrics.update({f"{k}_s/{key}": r[k] for k in ("generate", "teacher", "update")})
        metrics.update({f"total_s/{key}": total, f"ideal_s/{key}": bound,
                        f"measured_over_ideal/{key}": total / bound})
    notes = [
        f"peak fp32 FLOP/s: {peak / 1e9:.1f} GFLOP/s ([{cfg.matmul_n}, {cfg.matmul_n}] @ [{cfg.matmul_n}, "
        f"{cfg.matmul_n}], {torch.get_num_threads()} thread(s); {peak_before / 1e9:.1f} before the shapes, "
        f"{peak_after / 1e9:.1f} after)",
        "ideal ms = tokens/step * (2 P_teacher + 6 P_student) / peak; P = all parameters incl. embeddings and output "
        "head (teacher: the student's shape, another seed); tokens = response tokens generated (distilled)",
        "gen x, teacher x, update x = each part's seconds over its own bound (2 P_student, 2 P_teacher, 6 P_student "
        "FLOPs per token); generation is memory/latency bound at these sizes (one small decode step per token)",
    ]
    run_id = publish(cfg, f"bench-step-b{cfg.batch_size}-t{cfg.max_new_tokens}", HEADERS, rows, notes, metrics,
                     "bench_step")
    return {"headers": HEADERS, "rows": rows, "peak_flops": peak, "run_id": run_id}


def main(argv: list[str] | None = None) -> dict:
    return bench_step(parse_bench_config(argv, bench_step_config, __doc__))


if __name__ == "__main__":
    from tasks.cli import run_main

    sys.exit(run_main(main))
