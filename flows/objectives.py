"""Flow `compare-objectives`: one merge per entry of the objective menu, from the same base and the same teachers,
and one retention table (rows: variants, columns: routes) printed, logged to MLflow with a chart, and published as
a Prefect table artifact. Each merge is also its own MLflow run in `experiment` (named merge-<n>teachers-<variant>).

Run:  python -m flows.objectives --profile quick                      # every variant, ~1 min each
      python -m flows.objectives --profile quick --variants reverse_kl,sampled_token --opd.steps 300
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
from tasks.evaluation.compare import grouped_bars
from tasks.config import PipelineConfig, _deep_merge, known_names, pipeline_config
from tasks.evaluation.evaluate import route_mean
from tasks.common.log import say
from tasks.common.table import format_table
from tasks.tracking.runs import config_params, end_run, log_figure, log_table, start_run, tracking_uri

# name -> overrides of the merge's `opd` settings. Everything else (steps, lr, batch, seed) is shared.
VARIANTS: dict[str, dict[str, Any]] = {
    "reverse_kl": {},
    "forward_kl": {"loss": "forward_kl"},
    "jsd_0.5": {"loss": "jsd", "beta": 0.5},
    "skew_kl_0.1": {"loss": "skew_kl", "alpha": 0.1},
    "skew_reverse_kl_0.1": {"loss": "skew_reverse_kl", "alpha": 0.1},
    "reverse_kl_top8_tail": {"top_k": 8, "top_k_support": "tail"},
    "reverse_kl_top8_renorm_stopgrad": {"top_k": 8, "top_k_support": "renormalize", "top_k_stop_grad": True},
    "reverse_kl_top8_truncate": {"top_k": 8, "top_k_support": "truncate"},
    "reverse_kl_top8_truncate_stopgrad": {"top_k": 8, "top_k_support": "truncate", "top_k_stop_grad": True},
    "sampled_token": {"loss": "sampled_token", "correction": "clip"},
    "reverse_kl+reward": {"reward_weight": 0.5},
    "lambda_0.5": {"lmbda": 0.5, "off_policy_source": "teacher"},
    "two_stage": {"cold_start_steps": 100, "cold_start_loss": "forward_kl"},
    "reuse2_overlap": {"updates_per_batch": 2, "overlap_generation": True},
}


class ObjectivesConfig(PipelineConfig):
    """The pipeline's settings (world, base, specialists, shared merge settings) plus the variants to compare."""

    variants: list[str] = Field(default_factory=lambda: list(VARIANTS), description="Menu entries to run, in order.")
    experiment: str = Field("opd-objectives", min_length=1, description="MLflow experiment of the merges and summary.")

    @field_validator("variants")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        return known_names(v, VARIANTS, "variants")


def objectives_config(profile: str = "default", **overrides: Any) -> ObjectivesConfig:
    data = {**pipeline_config(profile).model_dump(), "experiment": "opd-objectives"}
    data["opd"]["cold_start_steps"] = 0  # every variant starts plain; the two_stage variant adds the stage
    return ObjectivesConfig.model_validate(_deep_merge(data, overrides))


def comparison_rows(results: dict[str, dict], minutes: dict[str, float]) -> tuple[list[str], list[list[Any]]]:
    """Header and rows of the comparison: the base and the teachers first, then one row per variant."""
    first = next(iter(results.values()))["rows"]
    routes = [r["route"] for r in first]
    headers = ["variant", *routes, "mean", "minutes"]

    def row(label: str, values: list[float], mins: float | None) -> list[Any]:
        return [label, *values, route_mean(values), mins]

    rows = [
        row("base (retention)", [r["base_accuracy"] / r["teacher_accuracy"] for r in first], None),
        row("teacher accuracy", [r["teacher_accuracy"] for r in first], None),
    ]
    for name, res in results.items():
        rows.append(row(name, [r["retention"] for r in res["rows"]], minutes[name]))
    return headers, rows


def comparison_figure(headers: list[str], rows: list[list[Any]]):
    """Grouped bars: retention per route for each variant, the base as a dashed line per route."""
    routes = headers[1:-2]
    variants = rows[2:]
    return grouped_bars([v[0] for v in variants], routes, [v[1:1 + len(routes)] for v in variants],
                        "Retention per route for each objective (mean in the legend)",
                        baseline=rows[0][1:1 + len(routes)])


def _name(cfg: ObjectivesConfig) -> str:
    return f"compare-objectives-{cfg.profile}-{len(cfg.variants)}variants-{cfg.opd.steps}steps-{stamp()}"


@flow(name="compare-objectives", flow_run_name=from_parameters(ObjectivesConfig, _name))
def compare_objectives(cfg: ObjectivesConfig = ObjectivesConfig()) -> dict:
    """base -> specialists (cached when already trained) -> one merge per variant -> one comparison table."""
    base = prepare_base(cfg.pretrain())
    teachers = train_specialists(cfg.specialists(base["uri"]))
    results, minutes = {}, {}
    for i, name in enumerate(cfg.variants, 1):
        say(f"[{i}/{len(cfg.variants)}] merge variant {name}: {VARIANTS[name] or 'defaults'}")
        mcfg = cfg.merge(base["uri"], teachers, VARIANTS[name], name)
        t0 = time.perf_counter()
        results[name] = merge(mcfg)
        minutes[name] = (time.perf_counter() - t0) / 60
    headers, rows = comparison_rows(results, minutes)
    table = format_table(headers, rows)
    summary = start_run(cfg.experiment, current_run_name(_name(cfg)), config_params(cfg),
                        {"merge_runs": ",".join(f"{n}={r['run_id']}" for n, r in results.items())})
    log_table(summary, [dict(zip(headers, r)) for r in rows], "objectives.json")
    log_figure(summary, comparison_figure(headers, rows), "objectives.png")
    end_run(summary)
    create_table_artifact(table=[dict(zip(headers, r)) for r in rows], key="objectives",
                          description=f"retention per objective; MLflow run {summary}")
    say(f"retention per route for each objective ({cfg.profile} profile, {cfg.opd.steps} on-policy steps):\n{table}\n"
        f"MLflow summary run {summary} (experiment {cfg.experiment}) in {tracking_uri()}")
    return {"summary_run_id": summary, "headers": headers, "rows": rows, "results": results, "table": table,
            "base_uri": base["uri"]}


def main(argv: list[str] | None = None) -> dict:
    from tasks.cli import parse_config, problems_of

    from teachers.preflight import preflight_pipeline

    # Refused before Prefect starts, with every problem the preflight finds; the flow runs it again (UI, deployments).
    cfg = parse_config(argv, objectives_config, __doc__, with_profile=True,
                       check=lambda c: problems_of(preflight_pipeline, c, say_warnings=False))
    return compare_objectives(cfg)


if __name__ == "__main__":
    from tasks.cli import run_main

    sys.exit(run_main(main))
