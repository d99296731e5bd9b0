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

Run:  python -m flows.bench.step              # shapes 64x2x2, 256x4x4, 512x6x8; batch 32, 32 new tokens
      python -m flows.bench.step --quick      # one tiny shape, one step (seconds)
      python -m flows.bench.step --shapes 128x3x4,1024x8x16 --batch_size 64 --threads 2

The table goes to stdout and to MLflow (experiment ``opd-bench``, run ``bench-step-...``).
"""

from __future__ import annotations

import sys

import torch
from pydantic import Field

from tasks.bench.helpers import BenchOPDConfig, matmul_flops, opd_steps, parse_bench_config, parse_shape, publish
from tasks.common.log import say
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


def bench_step_config(profile: str = "default") -> BenchStepConfig:
    if profile == "quick":
        return BenchStepConfig(shapes=["64x2x2"], batch_size=4, max_new_tokens=8, steps=1, matmul_n=256)
    return BenchStepConfig()


def time_shape(cfg: BenchStepConfig, shape: str) -> dict:
    """Mean seconds of each part of the timed steps, mean response tokens per step, and the parameter counts."""
    tok = build_char_tokenizer()
    student = create_model(tok, seed=cfg.seed, **parse_shape(shape).model_dump())
    teacher = create_model(tok, seed=cfg.seed + 1, **parse_shape(shape).model_dump()).eval().requires_grad_(False)
    step = opd_steps(cfg, student, teacher, tok)
    for i in range(cfg.warmup):
        step(i)
    timed = [step(i) for i in range(cfg.warmup, cfg.warmup + cfg.steps)]
    parts = {k: sum(s.seconds[k] for s in timed) / cfg.steps for k in ("generate", "teacher", "update")}
    return {"params": num_parameters(student), "teacher_params": num_parameters(teacher),
            "tokens": sum(s.tokens for s in timed) / cfg.steps, **parts}


HEADERS = ["shape", "params", "tokens/step", "gen ms", "teacher ms", "update ms", "total ms", "ideal ms",
           "measured/ideal", "gen x", "teacher x", "update x"]


def bench_step(cfg: BenchStepConfig) -> dict:
    torch.set_num_threads(cfg.threads)
    peak_before = matmul_flops(cfg.matmul_n)
    results = {}
    for shape in cfg.shapes:
        say(f"{shape}: {cfg.warmup} warm-up + {cfg.steps} timed steps, batch {cfg.batch_size}, "
            f"up to {cfg.max_new_tokens} new tokens")
        results[shape] = time_shape(cfg, shape)
    peak_after = matmul_flops(cfg.matmul_n)
    peak = max(peak_before, peak_after)
    rows, metrics = [], {"peak_gflops": peak / 1e9}
    for shape, r in results.items():
        Ps, Pt, n = r["params"], r["teacher_params"], r["tokens"]
        ideal = {"generate": n * 2 * Ps / peak, "teacher": n * 2 * Pt / peak, "update": n * 6 * Ps / peak}
        total = r["generate"] + r["teacher"] + r["update"]
        bound = ideal["teacher"] + ideal["update"]
        rows.append([shape, Ps, n, *(1e3 * r[k] for k in ("generate", "teacher", "update")), 1e3 * total, 1e3 * bound,
                     total / bound, *(r[k] / ideal[k] for k in ("generate", "teacher", "update"))])
        metrics.update({f"{k}_s/{shape}": r[k] for k in ("generate", "teacher", "update")})
        metrics.update({f"total_s/{shape}": total, f"ideal_s/{shape}": bound,
                        f"measured_over_ideal/{shape}": total / bound})
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
