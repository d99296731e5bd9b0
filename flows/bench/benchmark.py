"""Flow `benchmark`: does OPD pay for itself? From one base and one set of specialists on the built-in world (its
long-budget routes added, reported apart from the short ones), every method the issue names runs side by side:

  opd_reverse_kl        on-policy distillation, full-vocabulary reverse KL (the default merge)
  opd_sampled_token     on-policy, one teacher log-prob per sampled token (policy-gradient form)
  opd_two_stage         Qwen3's recipe: 100 steps of token KD on teacher samples, then on-policy reverse KL (the
                        cold start's steps and teacher samples count in its cost)
  token_kd              supervised token KD on teacher samples (forward KL, lambda = 0)
  sft_teacher_samples   off-policy SFT on teacher samples (cross-entropy on their tokens, lambda = 0)
  grpo_mix_rl           GRPO with the verifiers on the mixed prompts of every route (Mix-RL), no teacher
  merge_task_arithmetic / merge_ties / merge_dare   weight merging of the specialists (no training)
  exopd_rl              RL specialists (GRPO from the base) merged by OPD with reward extrapolation, one merge per
                        --exopd_scales entry (1.0 = plain OPD from RL teachers)

Each method's retention per route is recorded against optimizer steps, student rollout tokens, teacher-scored and
teacher-sampled tokens and training seconds. Printed and logged to MLflow (experiment `opd-benchmark`): steps and
rollout tokens each needs to reach --target_retention (or its best), the ratios to OPD reverse KL, retention per
route at the last evaluation, and a plot of the retention curves. Every merge is also its own MLflow run.

Run:  python -m flows.bench.benchmark --profile quick                       # every method, ~40 min on 2 CPU cores
      python -m flows.bench.benchmark --profile quick --methods '["opd_reverse_kl", "sft_teacher_samples"]' --opd.steps 200
"""

from __future__ import annotations

import sys
import time
from typing import Any

from prefect import flow
from prefect.artifacts import create_table_artifact
from pydantic import Field, field_validator

from flows.base import prepare_base
from flows.merge import merge
from flows.names import current_run_name, from_parameters, stamp
from flows.specialists import train_specialists
from tasks.bench.curves import (
    Curve,
    curve_from_run,
    curve_records,
    curves_figure,
    equal_step_rows,
    grpo_curve,
    summary_metrics,
    summary_rows,
    teacher_accuracies,
    weight_merge_curve,
)
from tasks.config import PipelineConfig, RLConfig, _deep_merge, known_names, pipeline_config
from tasks.common.log import say
from tasks.common.paths import models_dir
from tasks.specs.prompt_set import load_prompt_set
from tasks.common.table import format_table
from tasks.tracking.runs import config_params, end_run, log_figure, log_metrics, log_table, start_run, tracking_uri
from tasks.world.domains import Route
from teachers.registry import TeacherRegistry

# name -> what runs: a merge with these `opd` overrides, GRPO, a weight merge, or the ExOPD merges of RL specialists.
METHODS: dict[str, dict[str, Any]] = {
    "opd_reverse_kl": {"opd": {}},
    "opd_sampled_token": {"opd": {"loss": "sampled_token"}},
    "opd_two_stage": {"opd": {"cold_start_steps": 100, "cold_start_loss": "forward_kl"}},
    "token_kd": {"opd": {"loss": "forward_kl", "lmbda": 0.0, "off_policy_source": "teacher"}},
    "sft_teacher_samples": {"opd": {"loss": "sft", "lmbda": 0.0, "off_policy_source": "teacher"}},
    "grpo_mix_rl": {"rl": True},
    "merge_task_arithmetic": {"weights": "task_arithmetic"},
    "merge_ties": {"weights": "ties"},
    "merge_dare": {"weights": "dare"},
    "exopd_rl": {"exopd": True},
}
REFERENCE = "opd_reverse_kl"


class BenchmarkConfig(PipelineConfig):
    """The pipeline's settings (world, base, specialists, the merge's `opd` settings shared by every OPD/KD/SFT
    method) plus the methods to run and the baselines' own settings."""

    methods: list[str] = Field(default_factory=lambda: list(METHODS), description="Methods to run, in order.")
    target_retention: float = Field(0.9, gt=0, le=2.0, description="Mean retention whose cost is compared.")
    rl: RLConfig = Field(default_factory=RLConfig, description="The GRPO (Mix-RL) baseline.")
    rl_follows_opd: bool = Field(
        True, description="GRPO runs the merges' opd.steps and opd.eval_every, whatever rl.steps and rl.eval_every "
        "say (its rollouts per step stay rl.prompts_per_step x rl.group_size).")
    merge_density: float = Field(0.5, gt=0, le=1.0, description="TIES / DARE: fraction of each task vector kept.")
    merge_scale: float | None = Field(
        None, gt=0, le=10.0, description="Weight merges: scale of the merged task vector; empty = the deltas' mean "
        "(1 / number of specialists) for task arithmetic and DARE, which sum them, and 1 for TIES, which averages.")
    exopd_scales: list[float] = Field(default_factory=lambda: [1.0, 1.25],
                                      description="exopd_rl: one merge per reward scale (opd.reward_scale).")
    rl_specialist: RLConfig = Field(default_factory=RLConfig,
                                    description="exopd_rl: GRPO of the RL specialists (one per route, from the base).")
    experiment: str = Field("opd-benchmark", min_length=1, description="MLflow experiment of the runs and summary.")

    @field_validator("methods")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        return known_names(v, METHODS, "methods")

    def grpo(self) -> RLConfig:
        """The GRPO baseline's settings (matched to the merges when ``rl_follows_opd``)."""
        if not self.rl_follows_opd:
            return self.rl
        return self.rl.model_copy(update={"steps": self.opd.steps, "eval_every": self.opd.eval_every})

    @field_validator("exopd_scales")
    @classmethod
    def _scales(cls, v: list[float]) -> list[float]:
        if not v or any(not 0 <= s <= 10 for s in v):
            raise ValueError(f"exopd_scales must be a non-empty list of reward scales in [0, 10], got {v}")
        return v


def with_long_routes(world: dict[str, Any]) -> dict[str, Any]:
    """The world with the ``long`` budget of each of its domains added (problems of 5-6 letters for the letter
    domains, whose traces are then 47-62 characters; sort-long's are 63-66 at any length)."""
    world = {**world, "min_len": dict(world["min_len"]), "max_len": dict(world["max_len"])}
    domains = dict.fromkeys(Route.parse(r).domain for r in world["routes"])
    longs = [f"{d}-long" for d in domains if f"{d}-long" not in world["routes"]]
    world["routes"] = [*world["routes"], *longs]
    for r in longs:
        if not r.startswith("sort"):
            world["min_len"].setdefault(r, 5)
            world["max_len"].setdefault(r, 6)
    return world


def benchmark_config(profile: str = "default", **overrides: Any) -> BenchmarkConfig:
    """The profile's pipeline settings with long routes added and the merge gate at 0.5."""
    data = pipeline_config(profile).model_dump()
    opd = data["opd"]
    if not data["spec"]:  # the built-in world; a spec's routes (the real profile's) are the spec's own
        data["world"] = with_long_routes(data["world"])
        # Every method starts from the same base, which samples the long routes' format only about half the time:
        # the merge's gate (default 0.8) would refuse plain on-policy distillation before its first step. Here it
        # only refuses a student that cannot produce the format at all.
        opd["gate_threshold"] = 0.5
        opd["cold_start_steps"] = 0  # the methods start plain (the default is two-stage): opd_two_stage adds it
    # (the real profile keeps its cold start and gate: its base answers in sentences, and every method, on-policy or
    # not, starts with the same cold start (opd.cold_start_steps) on the routes' reference completions)
    data = {**data, "experiment": "opd-benchmark"}
    return BenchmarkConfig.model_validate(_deep_merge(data, overrides))


def _name(cfg: BenchmarkConfig) -> str:
    return f"benchmark-{cfg.profile}-{len(cfg.methods)}methods-{cfg.opd.steps}steps-{stamp()}"


def _merge_curve(cfg: BenchmarkConfig, base_uri: str, teachers: list[str], label: str, opd: dict,
                 routes: list[str]) -> tuple[Curve, dict]:
    result = merge(cfg.merge(base_uri, teachers, opd, label))
    return curve_from_run(result["run_id"], label, "merge", routes), result


@flow(name="benchmark", flow_run_name=from_parameters(BenchmarkConfig, _name))
def benchmark(cfg: BenchmarkConfig = BenchmarkConfig()) -> dict:
    """base -> specialists (cached) -> each method from the same base -> cost-to-target table, curves, MLflow."""
    base = prepare_base(cfg.pretrain())
    teachers = train_specialists(cfg.specialists(base["uri"]))
    prompt_set = base["prompt_set"]  # the prompt set prepare_base built (and the specialists used)
    registry = TeacherRegistry()
    teacher_acc = teacher_accuracies([registry.get(n) for n in teachers], prompt_set)
    routes = load_prompt_set(prompt_set).routes if cfg.spec else cfg.world.routes
    summary = start_run(cfg.experiment, current_run_name(_name(cfg)), config_params(cfg))
    curves: list[Curve] = []
    minutes: dict[str, float] = {}
    exopd: dict[str, dict] = {}
    for i, method in enumerate(cfg.methods, 1):
        spec = METHODS[method]
        say(f"[{i}/{len(cfg.methods)}] benchmark method {method}")
        t0 = time.perf_counter()
        if "opd" in spec:
            curves.append(_merge_curve(cfg, base["uri"], teachers, method, spec["opd"], routes)[0])
        elif "rl" in spec:
            rl = cfg.grpo()
            run_id = start_run(cfg.experiment, f"{method}-{stamp()}", {f"rl.{k}": v for k, v in config_params(rl).items()})
            curves.append(grpo_curve(rl, base["uri"], prompt_set, teacher_acc, run_id))
            end_run(run_id)
        elif "weights" in spec:
            out = models_dir() / "weight_merges" / f"{spec['weights']}-{cfg.config_hash()}"
            scale = cfg.merge_scale or (1.0 if spec["weights"] == "ties" else 1.0 / len(teachers))
            curves.append(weight_merge_curve(spec["weights"], base["uri"], [registry.get(n).model_uri for n in teachers],
                                             prompt_set, teacher_acc, str(out), cfg.merge_density, scale, cfg.opd.seed))
        else:
            rl_cfg = cfg.specialists(base["uri"]).model_copy(update={
                "trainer": "rl", "rl": cfg.rl_specialist, "name_prefix": "rlspec", "min_accuracy": 0.0})
            rl_teachers = train_specialists(rl_cfg)
            for scale in cfg.exopd_scales:
                label = f"exopd_rl_x{scale:g}"
                curve, result = _merge_curve(cfg, base["uri"], rl_teachers, label, {"reward_scale": scale},
                                             routes)
                curves.append(curve)
                exopd[label] = result
        minutes[method] = (time.perf_counter() - t0) / 60
        say(f"{method}: final mean retention {curves[-1].final.mean():.3f} ({minutes[method]:.1f} min)")

    reference = REFERENCE if any(c.method == REFERENCE for c in curves) else curves[0].method
    headers, rows = summary_rows(curves, routes, cfg.target_retention, reference)
    rheaders, rrows = equal_step_rows(curves, routes)
    table, rtable = format_table(headers, rows), format_table(rheaders, rrows)
    log_table(summary, [dict(zip(headers, r)) for r in rows], "benchmark.json")
    log_table(summary, [dict(zip(rheaders, r)) for r in rrows], "retention_by_route.json")
    log_table(summary, curve_records(curves), "curves.json")
    log_table(summary, [{"route": r, "teacher_accuracy": a} for r, a in teacher_acc.items()], "teachers.json")
    log_metrics(summary, summary_metrics(headers, rows), 0)
    log_figure(summary, curves_figure(curves, routes, cfg.target_retention), "retention_curves.png")
    exopd_text = ""
    if exopd:
        eh = ["route", "base acc", "RL teacher acc", *(f"{k} acc" for k in exopd), *(f"{k} retention" for k in exopd)]
        first = next(iter(exopd.values()))["rows"]
        erows = [[row["route"], row["base_accuracy"], row["teacher_accuracy"],
                  *(res["rows"][j]["student_accuracy"] for res in exopd.values()),
                  *(res["rows"][j]["retention"] for res in exopd.values())] for j, row in enumerate(first)]
        log_table(summary, [dict(zip(eh, r)) for r in erows], "exopd.json")
        exopd_text = f"\n\nExOPD from RL specialists (retention against the RL specialists):\n{format_table(eh, erows)}"
    end_run(summary, {"runs": ",".join(f"{c.method}={c.run_id}" for c in curves if c.run_id)})
    create_table_artifact(table=[dict(zip(headers, r)) for r in rows], key="benchmark",
                          description=f"cost to mean retention {cfg.target_retention}; MLflow run {summary}")
    say(f"benchmark ({cfg.profile} profile, {cfg.opd.steps} steps per trained method; training seconds leave "
        f"evaluations out):\n{table}\n\nretention per route at each method's last evaluation:\n{rtable}{exopd_text}\n"
        f"minutes per method (evaluations included): "
        + ", ".join(f"{k} {v:.1f}" for k, v in minutes.items())
        + f"\nMLflow summary run {summary} (experiment {cfg.experiment}) in {tracking_uri()}")
    return {"summary_run_id": summary, "headers": headers, "rows": rows, "curves": curves,
            "route_headers": rheaders, "route_rows": rrows, "teacher_accuracy": teacher_acc, "exopd": exopd}


def main(argv: list[str] | None = None) -> dict:
    from tasks.cli import parse_config, problems_of

    from teachers.preflight import preflight_pipeline

    # Refused before Prefect starts, with every problem the preflight finds; the flow runs it again (UI, deployments).
    cfg = parse_config(argv, benchmark_config, __doc__, with_profile=True,
                       check=lambda c: problems_of(preflight_pipeline, c, say_warnings=False))
    return benchmark(cfg)


if __name__ == "__main__":
    from tasks.cli import run_main

    sys.exit(run_main(main))
