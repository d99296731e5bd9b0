"""What the benchmarks in ``flows/bench/`` share: the ``--quick`` flag, a batch of the built-in world's prompts,
checkpoints made with this project's code, timing, peak memory and peak FLOP/s of this machine, and one MLflow run per
benchmark (params, metrics, the table as an MLflow table and as the printed text).

Benchmarks print ratios measured side by side in one run; they are not timed tests.
"""

from __future__ import annotations

import resource
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

import torch
from pydantic import BaseModel, Field, field_validator

from tasks.config import ModelConfig, WorldConfig, _Config
from tasks.common.table import format_table
from tasks.world.domains import domain_of, format_prompt, sample_problems
from tasks.world.spec import world_verifiers

C = TypeVar("C", bound=BaseModel)


def parse_bench_config(argv: list[str] | None, make_config: Callable[[str], C], doc: str) -> C:
    """Flags -> config, as every flow parses them; ``--quick`` (= ``--profile quick``) starts from
    ``make_config("quick")``, and any other flag overrides the preset."""
    from tasks.cli import parse_config

    argv = ["--profile=quick" if a == "--quick" else a for a in (argv or [])]
    return parse_config(argv, lambda profile="default": make_config(profile), doc, with_profile=True)


def world_batch(n: int, seed: int, world: WorldConfig | None = None) -> tuple[list[str], list[str], list[str]]:
    """``n`` prompts of the built-in world, its routes taken in turn, each route's problems drawn as the world draws
    them (its own lengths): ``(prompts, routes, answers)``, deterministic in ``seed``."""
    world = world or WorldConfig()
    routes = world.route_objs()
    per_route = {r.name: sample_problems(r, -(-n // len(routes)), seed, *world.lengths(r.name)) for r in routes}
    picked = [(routes[i % len(routes)], per_route[routes[i % len(routes)].name][i // len(routes)]) for i in range(n)]
    return ([format_prompt(r, p) for r, p in picked], [r.name for r, _ in picked],
            [domain_of(r).answer(p) for r, p in picked])


def parse_shape(text: str) -> ModelConfig:
    """``"256x4x4"`` -> a llama of hidden size 256, 4 layers, 4 heads and an MLP 4x as wide (this project's
    :class:`~tasks.config.ModelConfig`, which checks it)."""
    try:
        hidden, layers, heads = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"shape {text!r} is not HIDDENxLAYERSxHEADS, e.g. 256x4x4") from None
    return ModelConfig(hidden_size=hidden, num_layers=layers, num_heads=heads, intermediate_size=4 * hidden)


class BenchStepFields(_Config):
    """What every timing of our OPD step takes: its batch, steps, optimizer, threads and MLflow experiment
    (``flows.bench.step``, ``flows.bench.trl``, ``flows.bench.real_step``)."""

    batch_size: int = Field(16, ge=1, le=4096, description="Prompts per step.")
    warmup: int = Field(1, ge=1, description="Steps per shape (or variant) not counted.")
    steps: int = Field(4, ge=1, description="Timed steps per shape (or variant).")
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate.")
    chunk_size: int = Field(16, ge=1, description="Positions per chunk of our divergence.")
    threads: int = Field(1, ge=1, description="torch threads.")
    seed: int = Field(0, ge=0)
    experiment: str = Field("opd-bench", min_length=1, description="MLflow experiment.")


class BenchOPDConfig(BenchStepFields):
    """What the benchmarks of our OPD step on untrained checkpoints share (``flows.bench.step``,
    ``flows.bench.trl``): their shapes and the built-in world's prompts."""

    shapes: list[str] = Field(
        default_factory=lambda: ["64x2x2", "256x4x4"],
        description="Model shapes HIDDENxLAYERSxHEADS (MLP 4x hidden); the teacher has the student's shape.",
    )
    max_new_tokens: int = Field(32, ge=1, le=100, description="Rollout length cap.")

    @field_validator("shapes")
    @classmethod
    def _shapes(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("at least one shape is needed")
        for s in v:
            parse_shape(s)
        return v

    def prompts(self) -> tuple[list[str], list[str], list[str]]:
        """Every step's prompts: step i takes rows ``i * batch_size`` to ``(i + 1) * batch_size``."""
        return world_batch(self.batch_size * (self.warmup + self.steps), self.seed)


Batches = tuple[list[str], list[str], list[str]]  # every step's prompts, routes and answers, step after step


def opd_steps(cfg: BenchOPDConfig, student, teacher, tok, data: Batches | None = None,
              verifiers: dict | None = None) -> Callable[[int], Any]:
    """Step ``i`` of our plain on-policy loop (:func:`tasks.training.distill.opd_step`, reverse KL, one teacher for every row,
    this project's AdamW schedule) on ``data`` (prompts, routes, answers; default ``cfg.prompts()``, the built-in
    world's, scored by its ``verifiers``); each step's :class:`~tasks.training.distill.StepStats` also holds its
    wall time in ``seconds["step"]``."""
    from tasks.training.distill import opd_step
    from tasks.objectives.losses import Objective
    from tasks.modeling.teacher import checkpoint_teachers
    from tasks.training.sft import make_optimizer

    B = cfg.batch_size
    prompts, routes, answers = data or cfg.prompts()
    verifiers = verifiers or world_verifiers(list(set(routes)))
    optimizer, scheduler = make_optimizer(student, cfg.lr, 0.0, 0, cfg.warmup + cfg.steps)

    def step(i: int):
        rows = slice(i * B, (i + 1) * B)
        t0 = time.perf_counter()
        stats = opd_step(student, checkpoint_teachers({"teacher": teacher}), tok, prompts[rows], routes[rows],
                         answers[rows], {"teacher": list(range(B))}, optimizer, scheduler, cfg.max_new_tokens,
                         Objective(loss="reverse_kl"), cfg.chunk_size, grad_clip=1.0, verifiers=verifiers)
        stats.seconds["step"] = time.perf_counter() - t0
        return stats

    return step


def overlapped_opd_seconds(cfg: BenchOPDConfig, student, teacher, tok, data: Batches | None = None,
                           verifiers: dict | None = None) -> tuple[float, int]:
    """Our merge loop's overlapped step (``opd.overlap_generation``: :class:`tasks.training.distill.BatchProducer` makes the
    next batch in a background thread from a synced copy of the student while this step scores and updates) on
    ``cfg.prompts()``, reverse KL, one teacher. Runs ``cfg.warmup`` steps, then times ``cfg.steps`` back to back (the
    background generation runs during them, so only their wall time means anything). Returns (seconds, response
    tokens learned from) of the timed steps. ``data`` and ``verifiers`` as for :func:`opd_steps`."""
    from tasks.training.distill import BatchProducer, score_with_teachers, update_step
    from tasks.modeling.teacher import checkpoint_teachers
    from tasks.objectives.losses import Objective
    from tasks.training.sft import make_optimizer

    prompts, routes, answers = data or cfg.prompts()
    B, n = cfg.batch_size, len(prompts) // cfg.batch_size

    class InOrder:
        """The steps' prompts in order (wrapping round for the batch generated ahead of the last step)."""

        i = 0

        def draw(self, size: int):
            rows = slice((self.i % n) * B, (self.i % n) * B + size)
            self.i += 1
            return prompts[rows], routes[rows], answers[rows]

        def on_policy(self, lmbda: float) -> bool:
            return True

    optimizer, scheduler = make_optimizer(student, cfg.lr, 0.0, 0, cfg.warmup + cfg.steps)
    producer = BatchProducer(student, tok, InOrder(), None, {r: cfg.max_new_tokens for r in set(routes)}, B,
                             overlap=True, verifiers=verifiers or world_verifiers(list(set(routes))))
    objectives = {r: Objective(loss="reverse_kl") for r in set(routes)}
    tokens, t0 = 0, 0.0
    try:
        for i in range(cfg.warmup + cfg.steps):
            if i == cfg.warmup:
                t0 = time.perf_counter()
            batch = producer.next(1.0, i)
            hidden = score_with_teachers(checkpoint_teachers({"teacher": teacher}), {"teacher": list(range(B))}, batch.rollout)
            stats = update_step(student, batch, hidden, objectives, optimizer, scheduler, cfg.chunk_size, 1.0,
                                vocab_size=len(tok))
            tokens += stats.tokens if i >= cfg.warmup else 0
        seconds = time.perf_counter() - t0
    finally:
        producer.close()
    return seconds, tokens


def save_checkpoint(tok, shape: ModelConfig, seed: int, out_dir: str | Path) -> Path:
    """An untrained model of ``shape`` (this project's ``create_model``), saved with its tokenizer as a checkpoint."""
    from tasks.modeling.models import create_model, save_model

    return save_model(create_model(tok, seed=seed, **shape.model_dump()), tok, out_dir)


def median_seconds(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Median wall time of ``repeats`` calls of ``fn`` after one warm-up call, and the last call's result."""
    out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def reset_peak_rss() -> None:
    """Count this process's peak resident memory afresh from now (Linux: writing 5 to /proc/self/clear_refs resets
    VmHWM to the current RSS), so that :func:`peak_rss_mb` measures what follows, not a transient peak of start-up
    (imports, unpickling a spawned process's arguments). Elsewhere the count keeps its start-up peak."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_mb() -> float:
    """This process's peak resident memory since it started or since :func:`reset_peak_rss`, in MB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def matmul_flops(n: int = 2048, repeats: int = 5) -> float:
    """Peak fp32 FLOP/s of this CPU at the current torch thread count: the best of ``repeats`` ``[n, n] @ [n, n]``
    products (2 n^3 FLOPs each), after one warm-up."""
    gen = torch.Generator().manual_seed(0)
    a_N_N, b_N_N = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    out_N_N = torch.empty(n, n)
    torch.mm(a_N_N, b_N_N, out=out_N_N)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a_N_N, b_N_N, out=out_N_N)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def publish(cfg: BaseModel, run_name: str, headers: Sequence[str], rows: Sequence[Sequence[Any]], notes: Sequence[str],
            metrics: dict[str, float], name: str, tags: dict[str, str] | None = None) -> str:
    """Print the table and the notes under it, and log them as one finished MLflow run in ``cfg.experiment``: every
    config field as a param, ``metrics``, the table as ``<name>.json`` (an MLflow table) and the printed text as
    ``<name>.txt``. Returns the run id."""
    # MLflow is imported here, not at the top: the spawned processes of flows.bench.memory import this module and
    # measure RSS.
    from mlflow.tracking import MlflowClient

    from tasks.common.log import say
    from tasks.tracking.runs import config_params, end_run, log_metrics, log_table, start_run, tracking_uri

    text = "\n".join([format_table(headers, rows), *notes])
    print(text)
    run_id = start_run(cfg.experiment, run_name, config_params(cfg), tags)
    try:
        log_metrics(run_id, metrics, 0)
        log_table(run_id, [dict(zip(headers, r)) for r in rows], f"{name}.json")
        MlflowClient(tracking_uri()).log_text(run_id, text, f"{name}.txt")
    except BaseException:
        end_run(run_id, status="FAILED")
        raise
    end_run(run_id)
    say(f"MLflow run {run_id} (experiment {cfg.experiment}) in {tracking_uri()}")
    return run_id


def real_prompt_set(base: str | None = None):
    """``(base, prompt set)`` of the real profile: its converted base (``base``: that folder instead) and the merge's
    own prompt set of its routes, rendered with the base's template (built once, then cached in the state folder)."""
    from tasks.config import pipeline_config
    from tasks.modeling.convert import resolve_base
    from tasks.specs.prompt_set import load_prompt_set
    from tasks.training.pretrain import prompt_set_task

    real = pipeline_config("real")
    base = base or resolve_base(real.base_model)
    return base, load_prompt_set(prompt_set_task(real.spec, real.world, base))
