"""Comparing merges: retention per route across MLflow runs, the config fields that differ between them, and one
grouped bar chart (also used by the objective comparison)."""

from __future__ import annotations

import json
from typing import Any, Sequence

from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from tasks.evaluation.evaluate import route_mean
from tasks.tracking.runs import tracking_uri


def find_runs(run_ids: Sequence[str], experiment: str, filter_string: str = "", max_runs: int = 10) -> list[Run]:
    """The runs named by id, else the newest finished runs of ``experiment`` matching the MLflow ``filter_string``
    (for example ``params.`opd.loss` = 'reverse_kl'``) that have a ``retention/mean``."""
    client = MlflowClient(tracking_uri())
    if run_ids:
        return [client.get_run(r) for r in run_ids]
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise ValueError(f"no MLflow experiment {experiment!r} at {tracking_uri()}")
    query = " and ".join(x for x in ("attributes.status = 'FINISHED'", filter_string.strip()) if x)
    runs = client.search_runs([exp.experiment_id], query, order_by=["attributes.start_time DESC"], max_results=max_runs)
    return [r for r in runs if "retention/mean" in r.data.metrics]


def routes_of(runs: Sequence[Run]) -> list[str]:
    """Every route with a ``retention/<route>`` metric in any run: in the runs' ``world.routes`` order, then any
    others alphabetically."""
    seen: dict[str, None] = {}
    for run in runs:
        try:
            listed = json.loads(run.data.params.get("world.routes", "[]"))
        except json.JSONDecodeError:
            listed = []
        for r in listed:
            if f"retention/{r}" in run.data.metrics:
                seen[r] = None
    for run in runs:
        for key in sorted(run.data.metrics):
            if key.startswith("retention/") and key != "retention/mean":
                seen[key.split("/", 1)[1]] = None
    return list(seen)


def retention_rows(runs: Sequence[Run], routes: Sequence[str]) -> list[list[Any]]:
    """``[run name, run id, retention per route (None where a run lacks the route), mean]`` per run."""
    rows = []
    for run in runs:
        m = run.data.metrics
        rows.append([run.info.run_name, run.info.run_id, *(m.get(f"retention/{r}") for r in routes),
                     m.get("retention/mean")])
    return rows


SUMMARY_HEADERS = ["run", "run id", "mean retention", "worst retention", "mean gain rec.", "mean student exact",
                   "minutes", "student tokens"]


def summary_rows(runs: Sequence[Run], routes: Sequence[str]) -> list[list[Any]]:
    """One line per run, in :data:`SUMMARY_HEADERS` order: mean and worst route retention, mean gain recovered and
    mean exact-format student score over the routes that logged them (None where none did), wall minutes from the
    run's start to its end, and the student's rollout tokens over the merge (``rollout/student_tokens``)."""
    def mean_of(metrics: dict[str, float], prefix: str) -> float | None:
        values = [metrics[f"{prefix}/{r}"] for r in routes if f"{prefix}/{r}" in metrics]
        return sum(values) / len(values) if values else None

    rows = []
    for run in runs:
        m, info = run.data.metrics, run.info
        kept = [m[f"retention/{r}"] for r in routes if f"retention/{r}" in m]
        minutes = (info.end_time - info.start_time) / 60_000 if info.end_time and info.start_time else None
        tokens = m.get("rollout/student_tokens")
        rows.append([info.run_name, info.run_id, m.get("retention/mean"), min(kept) if kept else None,
                     mean_of(m, "gain_recovered"), mean_of(m, "exact"), minutes,
                     None if tokens is None else int(tokens)])
    return rows


def differing_params(runs: Sequence[Run]) -> dict[str, list[str | None]]:
    """The config fields (MLflow params) whose values are not the same in every run: field -> value per run."""
    keys = sorted({k for run in runs for k in run.data.params})
    out = {}
    for k in keys:
        values = [run.data.params.get(k) for run in runs]
        if len(set(values)) > 1:
            out[k] = values
    return out


def grouped_bars(labels: Sequence[str], groups: Sequence[str], values: Sequence[Sequence[float | None]],
                 title: str, ylabel: str = "retention", baseline: Sequence[float] | None = None):
    """One bar per label inside each group (``values[label][group]``, None drawn as no bar), an optional dashed
    baseline per group, the label's mean in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(8, 0.35 * len(labels) * len(groups)) + 3, 4.5))
    width = 0.8 / max(len(labels), 1)
    cmap = plt.get_cmap("tab20")
    for j, (label, vals) in enumerate(zip(labels, values)):
        present = [(i, v) for i, v in enumerate(vals) if v is not None]
        mean = route_mean(v for _, v in present) if present else float("nan")
        ax.bar([i - 0.4 + width * (j + 0.5) for i, _ in present], [v for _, v in present], width,
               label=f"{label} ({mean:.2f})", color=cmap(j % 20))
    for i, b in enumerate(baseline or []):
        ax.hlines(b, i - 0.42, i + 0.42, colors="black", linestyles="dashed", linewidth=1)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylim(0, 1.15)
    ax.set_ylabel(ylabel + (" (dashed: base)" if baseline else ""))
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return fig
