"""Flow `bench-teachers`: peak memory and step time of a merge with 2, 6 and 12 teachers, printed as ratios to the
2-teacher row (the goal: peak memory with 12 teachers < 2x that with 2, by keeping at most ``max_resident`` teachers
loaded). Each merge runs in its own process, so its peak RSS is its own; a last row keeps all 12 teachers resident
to show what the pool saves. Not a timed test: the numbers depend on the machine and its load.

The teachers are UNTRAINED random initialisations of ``teacher_model`` (larger than the student by default, so that
resident teachers dominate the process's memory); the student is one untrained ``student`` checkpoint shared by
every case. Each case runs the real merge loop (rollouts, per-teacher scoring, student update) for ``steps`` timed
on-policy steps after one warm-up step. The table is printed, logged to MLflow (experiment ``opd-bench-teachers``,
with a chart and one run per case) and published as a Prefect table artifact.

Run:  python -m flows.bench.teachers                                    # 2, 6, 12 teachers, 2 resident (~2 min)
      python -m flows.bench.teachers --max_resident 4 --steps 12 --teacher_model.hidden_size 1024 \
          --teacher_model.num_heads 16 --teacher_model.intermediate_size 4096
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

from mlflow.tracking import MlflowClient
from prefect import flow
from prefect.artifacts import create_table_artifact
from pydantic import Field, field_validator

from flows.names import from_parameters, stamp
from tasks.bench.helpers import peak_rss_mb
from tasks.config import MergeConfig, ModelConfig, OPDConfig, WorldConfig, _Config
from tasks.world.data import build_world
from tasks.specs.prompt_set import build_prompt_set
from tasks.world.spec import write_world_spec
from tasks.common.log import say
from tasks.merging.merge import MergeLoop, start_merge_run
from tasks.modeling.models import create_model, num_parameters, save_model
from tasks.common.paths import state_dir
from tasks.common.table import format_table
from tasks.world.tokenizer import build_char_tokenizer
from tasks.tracking.runs import config_params, end_run, log_figure, log_table, start_run, tracking_uri
from tasks.world.domains import all_routes
from teachers.registry import Provenance, TeacherRegistry
from teachers.router import Router


class BenchTeachersConfig(_Config):
    """What the teacher-pool benchmark runs: which teacher counts, how many stay resident, and the model shapes."""

    teacher_counts: list[int] = Field(
        default_factory=lambda: [2, 6, 12], description="Teachers per merge, one route each (the first N of the 12)."
    )
    max_resident: int = Field(2, ge=0, le=12, description="Teachers kept loaded at once in every case (0 = all).")
    all_resident_row: bool = Field(
        True, description="Add a row with the largest count and every teacher resident, for contrast."
    )
    steps: int = Field(8, ge=1, le=10_000, description="Timed on-policy steps per case (after one warm-up step).")
    batch_size: int = Field(24, ge=1, le=4096, description="Prompts per step, mixed uniformly over the routes.")
    max_new_tokens: int = Field(24, ge=1, le=100, description="Rollout length cap.")
    prompts_per_route: int = Field(200, ge=10, le=100_000, description="Training prompts generated per route.")
    student: ModelConfig = Field(default_factory=ModelConfig, description="Shape of the (untrained) student.")
    teacher_model: ModelConfig = Field(
        default_factory=lambda: ModelConfig(hidden_size=768, num_layers=4, num_heads=12, intermediate_size=3072),
        description="Shape of the (untrained) teachers.",
    )
    seed: int = Field(0, ge=0, description="Seed of the initialisations and the merge.")
    experiment: str = Field("opd-bench-teachers", min_length=1, description="MLflow experiment of the runs.")

    @field_validator("teacher_counts")
    @classmethod
    def _counts(cls, v: list[int]) -> list[int]:
        n = len(all_routes())
        if not v or any(not 1 <= k <= n for k in v):
            raise ValueError(f"teacher_counts must be 1..{n} each (the built-in world has {n} routes), got {v}")
        return v

    def cases(self) -> list[tuple[int, int]]:
        """(teachers, max_resident) per row; max_resident 0 = every teacher resident."""
        rows = [(k, self.max_resident) for k in self.teacher_counts]
        if self.all_resident_row and 0 < self.max_resident < max(self.teacher_counts):
            rows.append((max(self.teacher_counts), 0))
        return rows

    def setup_hash(self) -> str:
        """What the checkpoints, worlds and registry depend on (not the timing settings)."""
        keep = {"prompts_per_route", "student", "teacher_model", "seed"}
        return type(self)(**{k: getattr(self, k) for k in keep}).config_hash()

    def world(self, routes: list[str]) -> WorldConfig:
        return WorldConfig(routes=routes, train_size=self.prompts_per_route, eval_size=4, seed=self.seed)


def prepare_bench(cfg: BenchTeachersConfig) -> dict[str, Any]:
    """The student, one untrained teacher per route of the built-in world, a registry holding them and one prompt
    set per teacher count, under ``.opd/bench-teachers/<hash>`` (reused when they exist). Returns their paths."""
    root = state_dir() / "bench-teachers" / cfg.setup_hash()
    routes = [r.name for r in all_routes()]
    tok = build_char_tokenizer()
    registry = TeacherRegistry(root / "registry.json")
    if not (root / "DONE").exists():
        student = create_model(tok, seed=cfg.seed, **cfg.student.model_dump())
        save_model(student, tok, root / "student")
        for i, route in enumerate(routes):
            teacher = create_model(tok, seed=cfg.seed + 1 + i, **cfg.teacher_model.model_dump())
            path = save_model(teacher, tok, root / "teachers" / route)
            registry.register_checkpoint(f"bench-{route}", route, path, tok, replace=True,
                                         provenance=Provenance(source="bench-teachers", data="untrained"))
        sizes = {"teacher_params": num_parameters(teacher), "student_params": num_parameters(student)}
        (root / "sizes.json").write_text(json.dumps(sizes))
        (root / "DONE").write_text("ok\n")
    prompt_sets = {}
    for k in sorted({k for k, _ in cfg.cases()}):
        world = cfg.world(routes[:k])
        spec = write_world_spec(world, build_world(world, root=root / "world"))
        prompt_sets[k] = str(build_prompt_set(spec, root=root / "prompt_sets"))
    return {"routes": routes, "student": str(root / "student"), "registry": str(registry.path),
            "prompt_sets": prompt_sets,
            **json.loads((root / "sizes.json").read_text())}


def run_case(cfg: BenchTeachersConfig, setup: dict[str, Any], n_teachers: int, max_resident: int) -> dict[str, Any]:
    """One merge in the calling process over the first ``n_teachers`` routes, at most ``max_resident`` teachers
    loaded (0 = all): one warm-up step, then ``cfg.steps`` timed on-policy steps of the real merge loop. Returns
    the process's peak RSS, the mean step time and its teacher-scoring part, and the pool's loads and evictions."""
    routes = setup["routes"][:n_teachers]
    opd = OPDConfig(steps=cfg.steps, batch_size=cfg.batch_size, max_new_tokens=cfg.max_new_tokens, warmup_steps=0,
                    max_resident_teachers=max_resident, eval_every=1_000_000, seed=cfg.seed,
                    cold_start_steps=0)  # times on-policy steps only
    mcfg = MergeConfig(world=cfg.world(routes), student_uri=setup["student"], opd=opd,
                       experiment=cfg.experiment, label=f"{n_teachers}teachers-resident{max_resident or 'all'}")
    router = Router.from_registry(TeacherRegistry(setup["registry"]), routes)
    prompt_set = setup["prompt_sets"][n_teachers]
    run_id = start_merge_run(mcfg, router, f"bench-{mcfg.label}-{stamp()}", prompt_set)
    try:
        loop = MergeLoop(mcfg, prompt_set, router, run_id)
        objectives = {r: opd.objective(r) for r in routes}
        loop.stage("on_policy", 1, opd.lr, 1.0, objectives)  # warm-up: first loads, allocator growth
        loads, t0 = loop.pool.loads, time.perf_counter()
        loop.stage("on_policy", cfg.steps, opd.lr, 1.0, objectives)
        seconds = time.perf_counter() - t0
    except BaseException:
        end_run(run_id, status="FAILED")
        raise
    end_run(run_id)
    teacher = [m.value for m in MlflowClient(tracking_uri()).get_metric_history(run_id, "time/teacher") if m.step > 1]
    return {"teachers": n_teachers, "max_resident": max_resident, "peak_rss_mb": peak_rss_mb(),
            "step_s": seconds / cfg.steps, "teacher_s": sum(teacher) / max(len(teacher), 1),
            "loads_per_step": (loop.pool.loads - loads) / cfg.steps, "loads": loop.pool.loads,
            "evictions": loop.pool.evictions, "run_id": run_id}


def run_case_in_subprocess(cfg: BenchTeachersConfig, setup: dict[str, Any], n_teachers: int,
                           max_resident: int) -> dict[str, Any]:
    """:func:`run_case` in a fresh (spawned) process, so that the peak RSS it reports is that merge's alone."""
    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        return pool.submit(run_case, cfg, setup, n_teachers, max_resident).result()


HEADERS = ["teachers", "max resident", "peak RSS MB", "RSS x", "step s", "step x", "teacher s/step", "loads/step",
           "evictions"]


def bench_rows(results: list[dict[str, Any]]) -> list[list[Any]]:
    """One row per case; the ratios are to the first row (the smallest merge)."""
    ref = results[0]
    return [[r["teachers"], r["max_resident"] or "all", round(r["peak_rss_mb"]), r["peak_rss_mb"] / ref["peak_rss_mb"],
             r["step_s"], r["step_s"] / ref["step_s"], r["teacher_s"], r["loads_per_step"], r["evictions"]]
            for r in results]


def bench_figure(rows: list[list[Any]]):
    """Peak RSS and step time per case, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r[0]} teachers\n{r[1]} resident" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, col, unit in ((axes[0], 2, "peak RSS (MB)"), (axes[1], 4, "mean step time (s)")):
        bars = ax.bar(range(len(rows)), [r[col] for r in rows], color="#4c72b0")
        for b, r in zip(bars, rows):
            ax.annotate(f"{r[col + 1]:.2f}x", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                        va="bottom", fontsize=8)
        ax.set_xticks(range(len(rows)), labels, fontsize=8)
        ax.set_ylabel(unit)
    fig.suptitle("Merge with N teachers: ratios to the first row above the bars")
    fig.tight_layout()
    return fig


def _name(cfg: BenchTeachersConfig) -> str:
    counts = "-".join(map(str, cfg.teacher_counts))
    return f"bench-teachers-{counts}-resident{cfg.max_resident or 'all'}-{stamp()}"


@flow(name="bench-teachers", flow_run_name=from_parameters(BenchTeachersConfig, _name))
def bench_teachers(cfg: BenchTeachersConfig = BenchTeachersConfig()) -> dict:
    """Checkpoints -> one merge per case, each in its own process -> one table (printed, MLflow, Prefect)."""
    setup = prepare_bench(cfg)
    mb = setup["teacher_params"] * 4 / 2**20
    about = (f"teachers: UNTRAINED random initialisations, {setup['teacher_params'] / 1e6:.2f}M parameters = "
             f"{mb:.1f} MB fp32 each (hidden {cfg.teacher_model.hidden_size}, {cfg.teacher_model.num_layers} layers); "
             f"student: untrained, {setup['student_params'] / 1e6:.2f}M parameters; {cfg.steps} timed steps after 1 "
             f"warm-up, batch {cfg.batch_size}, up to {cfg.max_new_tokens} new tokens")
    say(about)
    results = []
    for i, (n, m) in enumerate(cfg.cases(), 1):
        say(f"[{i}/{len(cfg.cases())}] merge with {n} teachers, {m or 'all'} resident (own process)")
        results.append(run_case_in_subprocess(cfg, setup, n, m))
    rows = bench_rows(results)
    table = format_table(HEADERS, rows)
    small, large = results[0], next(r for r in results if r["teachers"] == max(cfg.teacher_counts))
    ratio = large["peak_rss_mb"] / small["peak_rss_mb"]
    verdict = (f"peak RSS with {large['teachers']} teachers = {ratio:.2f}x that with {small['teachers']} "
               f"(goal < 2x: {'met' if ratio < 2 else 'NOT met'})")
    summary = start_run(cfg.experiment, _name(cfg), config_params(cfg),
                        {"case_runs": ",".join(r["run_id"] for r in results), "teachers": "untrained"})
    records = [dict(zip(HEADERS, r)) for r in rows]
    log_table(summary, [{k: str(v) if k == "max resident" else v for k, v in rec.items()} for rec in records],
              "bench_teachers.json")
    log_figure(summary, bench_figure(rows), "bench_teachers.png")
    end_run(summary, {"result": verdict})
    create_table_artifact(table=records, key="bench-teachers", description=f"{about}; MLflow run {summary}")
    say(f"{about}\n{table}\n{verdict}\nMLflow run {summary} (experiment {cfg.experiment}) in {tracking_uri()}")
    return {"summary_run_id": summary, "headers": HEADERS, "rows": rows, "results": results, "ratio": ratio,
            "setup": setup}


def main(argv: list[str] | None = None) -> dict:
    from tasks.cli import parse_config

    return bench_teachers(parse_config(argv, BenchTeachersConfig, __doc__))


if __name__ == "__main__":
    from tasks.cli import run_main

    sys.exit(run_main(main))
