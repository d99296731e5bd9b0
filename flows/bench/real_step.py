"""Benchmark: where one merge step's time goes on the real profile (SmolLM2-135M-Instruct student, its registered
LoRA specialists as teachers, the profile's routes), one change at a time, side by side in one run.

Each variant starts a fresh student from the base and runs ``warmup`` + ``steps`` plain on-policy steps
(:func:`tasks.training.distill.opd_step`, reverse KL) on the same batches of the real profile's training prompts, each
row scored by its route's specialist (``spec-<route>`` in the registry: run the real profile, or
``flows.specialists --profile real``, first). The timed steps are averaged:

    fp32           the student and teachers in fp32, one cap (the longest route's) for every row
    caps           + each row under its own route's cap (what the merge does)
    bf16           + the student under bf16 autocast (fp32 master weights): the real profile's opd.dtype
    bf16-teachers  + the teachers' weights in bf16 (opd.teacher_dtype bf16)
    shared         + the teachers on one copy of their base, each with its adapter switched on (opd.teacher_sharing
                   adapters) instead of one merged model each
    lora           + a LoRA student (opd.lora_rank 16) instead of the full-weight one (teachers as in bf16-teachers)

Each row's ``vs first`` is its step time over the first variant's. Run:

    OMP_NUM_THREADS=2 python -m flows.bench.real_step               # 1 warm-up + 3 timed steps per variant, batch 8
    python -m flows.bench.real_step --variants fp32,bf16 --steps 5

The table goes to stdout and to MLflow (experiment ``opd-bench``, run ``bench-real-step-...``).
"""

from __future__ import annotations

import sys
from typing import Literal

import torch
from pydantic import Field

from tasks.bench.helpers import BenchStepFields, parse_bench_config, publish
from tasks.common.log import say

Variant = Literal["fp32", "caps", "bf16", "bf16-teachers", "shared", "lora"]
# What each variant changes over the one before it (the table's order is the config's).
SETTINGS: dict[str, dict] = {
    "fp32": {"caps": False, "dtype": "fp32", "teacher_dtype": "fp32", "sharing": "off", "lora_rank": 0},
    "caps": {"caps": True, "dtype": "fp32", "teacher_dtype": "fp32", "sharing": "off", "lora_rank": 0},
    "bf16": {"caps": True, "dtype": "bf16", "teacher_dtype": "fp32", "sharing": "off", "lora_rank": 0},
    "bf16-teachers": {"caps": True, "dtype": "bf16", "teacher_dtype": "bf16", "sharing": "off", "lora_rank": 0},
    "shared": {"caps": True, "dtype": "bf16", "teacher_dtype": "bf16", "sharing": "adapters", "lora_rank": 0},
    "lora": {"caps": True, "dtype": "bf16", "teacher_dtype": "bf16", "sharing": "off", "lora_rank": 16},
}


class BenchRealStepConfig(BenchStepFields):
    """Variants, batch and step counts of the real profile's step-time table (lr 1e-4: the real profile's opd.lr;
    seed: which training prompts, shuffled with it, make the batches)."""

    variants: list[Variant] = Field(default_factory=lambda: list(SETTINGS), min_length=1,
                                    description="Variants timed side by side, in this order: " + ", ".join(SETTINGS))
    batch_size: int = Field(8, ge=1, le=256, description="Prompts per step (the real profile's opd.batch_size).")
    steps: int = Field(3, ge=1, description="Timed steps per variant.")
    threads: int = Field(2, ge=1, description="torch threads.")
    teacher_prefix: str = Field("spec", min_length=1, description="Registry names of the teachers: <prefix>-<route>.")


def bench_real_step_config(profile: str = "default") -> BenchRealStepConfig:
    if profile == "quick":
        return BenchRealStepConfig(variants=["fp32", "bf16"], batch_size=3, steps=1)
    return BenchRealStepConfig()


def real_batches(cfg: BenchRealStepConfig, ps) -> list[tuple[list[str], list[str], list[str]]]:
    """``warmup + steps`` batches of ``(prompts, routes, answers)``, the routes taken in turn, the same for every
    variant."""
    import random

    train = ps.rows("train")
    rng = random.Random(cfg.seed)
    order = {r: rng.sample(range(len(rows["prompt"])), len(rows["prompt"])) for r, rows in train.items()}
    routes = list(train)
    out = []
    for i in range(cfg.warmup + cfg.steps):
        picked = [(routes[j % len(routes)], (i * cfg.batch_size + j) // len(routes)) for j in range(cfg.batch_size)]
        out.append(([train[r]["prompt"][order[r][k]] for r, k in picked], [r for r, _ in picked],
                     [train[r]["answer"][order[r][k]] for r, k in picked]))
    return out


def time_variant(cfg: BenchRealStepConfig, variant: str, base: str, ps, records, batches) -> dict:
    """Mean seconds of generation, teacher scoring and update over the timed steps, and response tokens a step."""
    from tasks.modeling.device import place_frozen, place_trained
    from tasks.modeling.models import load_model, num_parameters
    from tasks.modeling.shared_base import SharedBase, sharing_groups
    from tasks.modeling.teacher import checkpoint_teachers
    from tasks.objectives.losses import Objective
    from tasks.specs.tokenizer import load_tokenizer
    from tasks.training.distill import opd_step
    from tasks.training.sft import make_optimizer, with_lora
    from tasks.config import OPDConfig

    s = SETTINGS[variant]
    tok = load_tokenizer(base)
    student = place_trained(with_lora(load_model(base), OPDConfig(lora_rank=s["lora_rank"], seed=cfg.seed)), "cpu",
                            s["dtype"])
    def frozen(uri, base=None):
        return place_frozen(load_model(uri, base=base), "cpu", s["teacher_dtype"])

    if s["sharing"] == "adapters":
        groups = sharing_groups(records)
        if len(groups) != 1 or len(next(iter(groups.values()))) != len(records):
            raise SystemExit(f"error: variant shared needs every teacher to be a LoRA adapter of one base; found "
                             f"{groups}")
        (shared_base, adapters), = groups.items()
        teachers = SharedBase(shared_base, adapters, lambda: frozen(shared_base))
        held = num_parameters(teachers[next(iter(adapters))])
    else:
        teachers = {r: frozen(rec.model_uri, rec.base_model or None) for r, rec in records.items()}
        held = sum(num_parameters(m) for m in teachers.values())
    optimizer, scheduler = make_optimizer(student, cfg.lr, 0.0, 0, cfg.warmup + cfg.steps)
    longest = max(ps.cap(r) for r in records)
    # Seeded after every load (a peft adapter's init draws from the global RNG): the same rollouts for every
    # variant of one dtype.
    torch.manual_seed(cfg.seed)
    timed = []
    for i, (prompts, routes, answers) in enumerate(batches):
        groups: dict[str, list[int]] = {}
        for row, r in enumerate(routes):
            groups.setdefault(r, []).append(row)
        caps = [ps.cap(r) for r in routes] if s["caps"] else longest
        stats = opd_step(student, checkpoint_teachers(teachers), tok, prompts, routes, answers, groups, optimizer,
                         scheduler, caps, Objective(loss="reverse_kl"), cfg.chunk_size, grad_clip=1.0,
                         verifiers=ps.verifiers)
        if i >= cfg.warmup:
            timed.append(stats)
    parts = {k: sum(st.seconds[k] for st in timed) / cfg.steps for k in ("generate", "teacher", "update")}
    return {"tokens": sum(st.tokens for st in timed) / cfg.steps, "teacher_params": held, **parts}


HEADERS = ["variant", "changes", "tokens/step", "gen s", "teacher s", "update s", "step s", "vs first",
           "teacher params M"]


def bench_real_step(cfg: BenchRealStepConfig) -> dict:
    from tasks.bench.helpers import real_prompt_set
    from teachers.registry import TeacherRegistry

    torch.set_num_threads(cfg.threads)
    base, ps = real_prompt_set()  # the merge's own prompt set
    registry = TeacherRegistry()
    names = {r: f"{cfg.teacher_prefix}-{r}" for r in ps.routes}
    missing = [n for n in names.values() if n not in registry.names()]
    if missing:
        raise SystemExit(f"error: no teacher(s) {missing} in the registry {registry.path}: train the real profile's "
                         "specialists first (python -m flows.pipeline --profile real)")
    records = {r: registry.get(n) for r, n in names.items()}
    batches = real_batches(cfg, ps)
    results = {}
    for v in cfg.variants:
        say(f"{v}: {cfg.warmup} warm-up + {cfg.steps} timed steps, batch {cfg.batch_size}, routes {list(records)}")
        results[v] = time_variant(cfg, v, base, ps, records, batches)
    first = cfg.variants[0]
    totals = {v: r["generate"] + r["teacher"] + r["update"] for v, r in results.items()}
    rows, metrics = [], {}
    for v, r in results.items():
        changes = ", ".join(f"{k} {val}" for k, val in SETTINGS[v].items())
        rows.append([v, changes, r["tokens"], r["generate"], r["teacher"], r["update"], totals[v],
                     totals[v] / totals[first], r["teacher_params"] / 1e6])
        metrics.update({f"{k}_s/{v}": r[k] for k in ("generate", "teacher", "update")})
        metrics[f"step_s/{v}"] = totals[v]
        metrics[f"teacher_params/{v}"] = r["teacher_params"]
    notes = [f"{torch.get_num_threads()} thread(s); teachers {sorted(n for n in names.values())}; the same "
             f"{cfg.warmup + cfg.steps} batches for every variant; each a fresh student from {base}"]
    run_id = publish(cfg, f"bench-real-step-b{cfg.batch_size}", HEADERS, rows, notes, metrics, "bench_real_step")
    return {"headers": HEADERS, "rows": rows, "run_id": run_id}


def main(argv: list[str] | None = None) -> dict:
    return bench_real_step(parse_bench_config(argv, bench_real_step_config, __doc__))


if __name__ == "__main__":
    from tasks.cli import run_main

    sys.exit(run_main(main))
