"""Flow `compare-merges`: retention per route across merge runs, each run in sum (mean and worst retention, gain
recovered, exact-format score, minutes, student tokens) and the config fields that differ between them, as tables and
a chart, logged to MLflow (experiment `opd-compare`) and published as Prefect artifacts.

Run:  python -m flows.compare                                   # the 10 newest finished merges of `opd-merge`
      python -m flows.compare --run_ids '["<id1>", "<id2>"]'
      python -m flows.compare --filter "params.\\`opd.loss\\` = 'reverse_kl'" --max_runs 5
"""

from __future__ import annotations

import sys

from prefect import flow
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from pydantic import Field

from flows.names import from_parameters, stamp
from tasks.evaluation.compare import (SUMMARY_HEADERS, differing_params, find_runs, grouped_bars, retention_rows,
                                      routes_of, summary_rows)
from tasks.config import _Config
from tasks.common.log import link, redact, say
from tasks.preflight import InputError, Problem
from tasks.common.table import format_table
from tasks.tracking.runs import end_run, log_figure, log_params, log_table, run_url, start_run, tracking_uri


class CompareConfig(_Config):
    """Which merge runs to compare: explicit MLflow run ids, or a search in an experiment."""

    run_ids: list[str] = Field(default_factory=list, description="MLflow run ids; empty = search `experiment`.")
    experiment: str = Field("opd-merge", min_length=1, description="Experiment searched when no run ids are given.")
    filter: str = Field("", description="MLflow search filter, e.g. params.`opd.loss` = 'reverse_kl'.")
    max_runs: int = Field(10, ge=2, le=100, description="Newest finished runs taken from the search.")
    output_experiment: str = Field("opd-compare", min_length=1, description="MLflow experiment of the comparison.")


class NoMergesYet(InputError):
    """Fewer than two merge runs to compare (on a fresh state folder: none at all)."""


def merge_runs(cfg: CompareConfig) -> list:
    """The runs to compare. Raises :class:`NoMergesYet` when there are fewer than two, and :class:`InputError` when
    MLflow refuses the run ids or the filter."""
    from mlflow.exceptions import MlflowException

    where = redact(tracking_uri())
    try:
        runs = find_runs(cfg.run_ids, cfg.experiment, cfg.filter, cfg.max_runs)
    except ValueError:  # find_runs: no such experiment, i.e. no merge ever ran against this store
        runs = []
    except MlflowException as e:
        if e.error_code not in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            raise
        field = "run_ids" if cfg.run_ids else "filter"
        raise InputError([Problem(where, field, f"{' '.join(str(e).split())}; expected "
                          + ("ids of runs in this MLflow store" if cfg.run_ids else "an MLflow search filter"))],
                         "config") from None
    if len(runs) < 2:
        asked = (f"run_ids {cfg.run_ids}" if cfg.run_ids else f"experiment {cfg.experiment!r}"
                 + (f" with filter {cfg.filter!r}" if cfg.filter else ""))
        raise NoMergesYet([Problem(where, "run_ids" if cfg.run_ids else "experiment",
                                   f"{len(runs)} finished merge run(s) with retention/mean for {asked}; need at least "
                                   "2 merge runs to compare: run python -m flows.merge first (e.g. twice, with "
                                   "different --opd.loss), or pass --run_ids")], "config")
    return runs


def _name(cfg: CompareConfig) -> str:
    what = f"{len(cfg.run_ids)}runs" if cfg.run_ids else cfg.experiment
    return f"compare-merges-{what}-{stamp()}"


@flow(name="compare-merges", flow_run_name=from_parameters(CompareConfig, _name))
def compare_merges(cfg: CompareConfig = CompareConfig()) -> dict:
    """Find the runs, tabulate retention per route and the differing config fields, chart, log, publish."""
    runs = merge_runs(cfg)
    routes = routes_of(runs)
    rows = retention_rows(runs, routes)
    headers = ["run", "run id", *routes, "mean"]
    summary = summary_rows(runs, routes)
    diff = differing_params(runs)
    table = format_table(headers, [[r[0], r[1][:8], *r[2:]] for r in rows])
    summary_table = format_table(SUMMARY_HEADERS, [[r[0], r[1][:8], *r[2:]] for r in summary])
    diff_table = format_table(["field", *(r[1][:8] for r in rows)], [[k, *v] for k, v in diff.items()])
    say(f"retention per route across {len(runs)} merges:\n{table}\n\neach merge in sum:\n{summary_table}\n\n"
        f"config fields that differ:\n{diff_table}")

    out = start_run(cfg.output_experiment, _name(cfg), {"compared_runs": ",".join(r[1] for r in rows),
                                                        "routes": ",".join(routes)})
    records = [dict(zip(headers, r)) for r in rows]
    log_table(out, records, "retention_by_run.json")
    log_table(out, [dict(zip(SUMMARY_HEADERS, r)) for r in summary], "summary_by_run.json")
    if diff:
        log_table(out, [{"field": k, **{r[1]: v for r, v in zip(rows, vals)}} for k, vals in diff.items()],
                  "differing_params.json")
    fig = grouped_bars([r[0] for r in rows], routes, [r[2:2 + len(routes)] for r in rows],
                       f"Retention per route across {len(runs)} merges (mean in the legend)")
    log_figure(out, fig, "retention_by_run.png")
    log_params(out, {"differing_fields": ",".join(diff) or "-"})
    end_run(out)
    create_table_artifact(table=records, key="merge-comparison", description=f"MLflow run {out}")
    create_markdown_artifact(
        "### Config fields that differ\n\n| field | " + " | ".join(r[0] for r in rows) + " |\n|---|"
        + "---|" * len(rows) + "\n" + "".join(f"| `{k}` | " + " | ".join(str(v) for v in vals) + " |\n"
                                             for k, vals in diff.items()),
        key="merge-comparison-config", description="Config fields whose values differ between the compared runs")
    link(run_url(out), "MLflow comparison run (table and chart)", "merge-comparison-mlflow")
    return {"run_id": out, "headers": headers, "rows": rows, "summary": summary, "differing": diff, "table": table,
            "summary_table": summary_table}


def main(argv: list[str] | None = None) -> dict:
    from tasks.cli import parse_config

    cfg = parse_config(argv, CompareConfig, __doc__)
    merge_runs(cfg)  # refused before Prefect starts
    return compare_merges(cfg)


if __name__ == "__main__":
    from tasks.cli import run_main

    sys.exit(run_main(main))
