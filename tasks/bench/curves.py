"""The method benchmark's pieces: what each method costs on the way to a retention target, read from its MLflow
run, and the two baselines that are not a merge run (GRPO on the mixed prompts, weight merging).

A method's record is a :class:`Curve`: one :class:`Point` per evaluation, with the retention per route and what
the method had spent by then: optimizer steps, response tokens the student sampled (its own rollouts), response
tokens the teachers sampled (off-policy data), tokens the teachers scored (one forward each) and training seconds
(generation, scoring and updates; evaluations left out). Routes split into ``short`` (low and high budgets) and
``long`` (the long budget's >= 40-character traces), reported apart.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from mlflow.tracking import MlflowClient

from tasks.evaluation.evaluate import route_mean
from tasks.common.log import say
from tasks.tracking.runs import tracking_uri
from tasks.world.domains import Route


@dataclass
class Point:
    step: int
    retention: dict[str, float]  # route -> retention
    student_tokens: float = 0.0
    teacher_sampled_tokens: float = 0.0
    teacher_scored_tokens: float = 0.0
    seconds: float = 0.0

    def mean(self, routes: Sequence[str] | None = None) -> float:
        vals = [self.retention[r] for r in (routes if routes is not None else self.retention)]
        return route_mean(vals) if vals else float("nan")


@dataclass
class Curve:
    method: str
    kind: str  # merge | rl | weights
    points: list[Point] = field(default_factory=list)
    run_id: str = ""

    @property
    def final(self) -> Point:
        return self.points[-1]

    def best(self) -> Point:
        return max(self.points, key=lambda p: p.mean())


def route_groups(routes: Sequence[str]) -> dict[str, list[str]]:
    """``{"short": [...low/high routes], "long": [...long routes]}``, empty groups left out."""
    groups = {"short": [r for r in routes if Route.parse(r).budget != "long"],
              "long": [r for r in routes if Route.parse(r).budget == "long"]}
    return {k: v for k, v in groups.items() if v}


def first_reaching(curve: Curve, target: float) -> Point | None:
    """The first evaluation whose mean retention is >= ``target`` (None if it never does)."""
    return next((p for p in curve.points if p.mean() >= target), None)


def _last_at(history: list[tuple[int, float]], step: int) -> float:
    """The last value logged at or before ``step`` (cumulative counters logged on some steps only); 0 if none."""
    value = 0.0
    for s, v in history:
        if s > step:
            break
        value = v
    return value


def curve_from_run(run_id: str, method: str, kind: str, routes: Sequence[str]) -> Curve:
    """A merge (or GRPO) run's curve from its MLflow metric history: every step with a ``retention/mean``."""
    client = MlflowClient(tracking_uri())

    def history(key: str) -> list[tuple[int, float]]:
        return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))

    keys = client.get_run(run_id).data.metrics
    teacher_keys = [k for k in keys if k.startswith("teacher_tokens/")]
    counters = {k: history(k) for k in ("rollout/student_tokens", "rollout/teacher_sampled_tokens",
                                        "time/train_total", *teacher_keys)}
    per_route = {r: dict(history(f"retention/{r}")) for r in routes}
    curve = Curve(method, kind, run_id=run_id)
    for step, _ in history("retention/mean"):
        curve.points.append(Point(
            step=step,
            retention={r: per_route[r][step] for r in routes},
            student_tokens=_last_at(counters["rollout/student_tokens"], step),
            teacher_sampled_tokens=_last_at(counters["rollout/teacher_sampled_tokens"], step),
            teacher_scored_tokens=sum(_last_at(counters[k], step) for k in teacher_keys),
            seconds=_last_at(counters["time/train_total"], step),
        ))
    if not curve.points:
        raise ValueError(f"run {run_id} ({method}) has no retention/mean history")
    return curve


def _ratio(x: float | None, ref: float | None) -> float | None:
    if x is None or ref is None or ref == 0:
        return None
    return x / ref


def summary_rows(curves: Sequence[Curve], routes: Sequence[str], target: float,
                 reference: str) -> tuple[list[str], list[list[Any]]]:
    """One row per method: final mean retention (all, short, long routes), the best mean, and the steps, student
    rollout tokens, teacher-scored tokens and training seconds at the first evaluation reaching ``target`` (else at
    its best evaluation, marked ``best``), with the ratios of steps and student rollout tokens to ``reference``'s."""
    groups = route_groups(routes)
    headers = ["method", "final mean", *(f"final {g}" for g in groups), "best mean", f"reached {target:g}",
               "steps", "student tok", "teacher scored tok", "teacher sampled tok", "train s",
               f"steps / {reference}", f"student tok / {reference}"]
    at = {c.method: (first_reaching(c, target), c.best()) for c in curves}
    ref_point = at[reference][0] or at[reference][1] if reference in at else None
    rows = []
    for c in curves:
        hit, best = at[c.method]
        p = hit or best
        rows.append([c.method, c.final.mean(), *(c.final.mean(g) for g in groups.values()), best.mean(),
                     "yes" if hit else "best", p.step, p.student_tokens, p.teacher_scored_tokens,
                     p.teacher_sampled_tokens, p.seconds,
                     _ratio(p.step, ref_point.step if ref_point else None),
                     _ratio(p.student_tokens, ref_point.student_tokens if ref_point else None)])
    return headers, rows


def equal_step_rows(curves: Sequence[Curve], routes: Sequence[str]) -> tuple[list[str], list[list[Any]]]:
    """Retention per route (and the short/long means) of every method at its last evaluation."""
    groups = route_groups(routes)
    headers = ["method", "step", *routes, *(f"{g} mean" for g in groups), "mean"]
    rows = [[c.method, c.final.step, *(c.final.retention[r] for r in routes),
             *(c.final.mean(g) for g in groups.values()), c.final.mean()] for c in curves]
    return headers, rows


def curves_figure(curves: Sequence[Curve], routes: Sequence[str], target: float):
    """Mean retention against optimizer steps, student rollout tokens and training seconds, and the short and long
    routes' means against steps; single-point methods (weight merges) as horizontal dotted lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = route_groups(routes)
    panels = [("optimizer steps", lambda p: p.step, None), ("student rollout tokens", lambda p: p.student_tokens, None),
              ("training seconds", lambda p: p.seconds, None),
              *((f"optimizer steps ({g} routes)", lambda p: p.step, rs) for g, rs in groups.items())]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4), squeeze=False)
    cmap = plt.get_cmap("tab20")
    for ax, (xlabel, x, subset) in zip(axes[0], panels):
        for j, c in enumerate(curves):
            color = cmap(j % 20)
            ys = [p.mean(subset) for p in c.points]
            if len(c.points) == 1:
                ax.axhline(ys[0], color=color, linestyle=":", label=c.method)
            else:
                ax.plot([x(p) for p in c.points], ys, marker="o", markersize=3, color=color, label=c.method)
        ax.axhline(target, color="grey", linewidth=0.8, linestyle="--")
        ax.set_xlabel(xlabel)
        ax.set_ylim(0, 1.15)
        ax.set_title("mean retention" + (f", {'short' if subset == groups.get('short') else 'long'}" if subset else ""),
                     fontsize=9)
    axes[0][0].set_ylabel("retention (dashed: target)")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return fig


def curve_records(curves: Sequence[Curve]) -> list[dict[str, Any]]:
    """Every evaluation of every method as one flat record (the data behind the plot, per route)."""
    return [{"method": c.method, "kind": c.kind, "step": p.step, "student_tokens": p.student_tokens,
             "teacher_sampled_tokens": p.teacher_sampled_tokens, "teacher_scored_tokens": p.teacher_scored_tokens,
             "train_seconds": p.seconds, "mean": p.mean(), **{f"retention/{r}": v for r, v in p.retention.items()}}
            for c in curves for p in c.points]


def summary_metrics(headers: list[str], rows: list[list[Any]]) -> dict[str, float]:
    """The summary table as MLflow metrics ``<column>/<method>`` (finite numbers only, names MLflow accepts)."""
    out = {}
    for row in rows:
        for h, v in zip(headers[1:], row[1:]):
            if isinstance(v, (int, float)) and math.isfinite(v):
                key = h.replace(" / ", "_over_").replace(" ", "_").replace(".", "_")
                out[f"{key}/{row[0]}"] = float(v)
    return out


# ------------------------------------------------------------------------------------------- non-merge baselines


def held_out(prompt_set: str, routes: Sequence[str]):
    """The routes' held-out sets, caps and verifiers, as a merge evaluates them (the prompt set's spec)."""
    from tasks.specs.prompt_set import load_prompt_set

    ps = load_prompt_set(prompt_set)
    sets, caps = ps.eval_sets(), ps.caps()
    return {r: sets[r] for r in routes}, {r: caps[r] for r in routes}, {r: ps.verifier(r) for r in routes}


def teacher_accuracies(records, prompt_set: str) -> dict[str, float]:
    """Each teacher's held-out accuracy on its own route, measured as a merge measures it (greedy, the same cap)."""
    from tasks.evaluation.evaluate import evaluate_route
    from tasks.modeling.models import load_model
    from tasks.specs.tokenizer import load_tokenizer

    tok = load_tokenizer(records[0].model_uri)  # every teacher shares it (the registry checked the fingerprints)
    evals, caps, verifiers = held_out(prompt_set, [rec.route for rec in records])
    return {rec.route: evaluate_route(load_model(rec.model_uri).eval(), tok, verifiers[rec.route], *evals[rec.route],
                                      caps[rec.route]).accuracy
            for rec in records}


def grpo_curve(cfg, base_uri: str, prompt_set: str, teacher_acc: dict[str, float], run_id: str) -> Curve:
    """GRPO from the base on the mixed prompts of every route (Mix-RL), evaluated every ``cfg.eval_every`` steps
    like a merge; logs ``retention/<route>``, ``rollout/student_tokens`` and ``time/train_total`` to ``run_id``.
    ``cfg`` is an :class:`tasks.config.RLConfig`."""
    from tasks.evaluation.evaluate import evaluate_routes
    from tasks.merging.merge import route_metrics
    from tasks.modeling.models import load_model
    from tasks.specs.prompt_set import load_prompt_set
    from tasks.training.rl import run_grpo
    from tasks.specs.tokenizer import load_tokenizer
    from tasks.tracking.runs import log_metrics

    tok = load_tokenizer(base_uri)
    model = load_model(base_uri).eval()
    routes = list(teacher_acc)
    train = {r: s for r, s in load_prompt_set(prompt_set).train_sets().items() if r in routes}
    evals, caps, verifiers = held_out(prompt_set, routes)
    cap = max(caps.values())  # GRPO rolls out every route under one cap
    curve = Curve("grpo_mix_rl", "rl", run_id=run_id)
    spent = {"tokens": 0.0, "seconds": 0.0}

    def point(step: int) -> None:
        m = route_metrics(evaluate_routes(model, tok, evals, caps, verifiers), teacher_acc)
        curve.points.append(Point(step, {r: m[f"retention/{r}"] for r in routes}, student_tokens=spent["tokens"],
                                  seconds=spent["seconds"]))
        log_metrics(run_id, {**m, "rollout/student_tokens": spent["tokens"], "time/train_total": spent["seconds"]},
                    step)

    def on_step(st) -> None:
        spent["tokens"] += st.rollout_tokens
        spent["seconds"] += st.seconds
        log_metrics(run_id, {"train/loss": st.loss, **{f"rl/reward/{r}": v for r, v in st.reward.items()}}, st.step)
        if st.step % cfg.eval_every == 0 or st.step == cfg.steps:
            point(st.step)

    point(0)
    t0 = time.perf_counter()
    run_grpo(model, tok, train, cfg, cap, on_step, verifiers=verifiers)
    say(f"GRPO (Mix-RL): {cfg.steps} steps in {time.perf_counter() - t0:.0f}s")
    return curve


def weight_merge_curve(method: str, base_uri: str, expert_uris: list[str], prompt_set: str,
                       teacher_acc: dict[str, float], out_dir: str, density: float, scale: float, seed: int) -> Curve:
    """One weight merge of the specialists (task arithmetic, TIES or DARE; :mod:`tasks.merging.weight_merge`), evaluated once:
    no training, so its one point costs nothing but the merge."""
    from tasks.evaluation.evaluate import evaluate_routes
    from tasks.merging.merge import route_metrics
    from tasks.modeling.models import load_model
    from tasks.specs.tokenizer import load_tokenizer
    from tasks.merging.weight_merge import merge_checkpoints

    t0 = time.perf_counter()
    path = merge_checkpoints(base_uri, expert_uris, method, out_dir, density=density, scale=scale, seed=seed)
    seconds = time.perf_counter() - t0
    tok = load_tokenizer(path)
    routes = list(teacher_acc)
    evals, caps, verifiers = held_out(prompt_set, routes)
    m = route_metrics(evaluate_routes(load_model(path).eval(), tok, evals, caps, verifiers), teacher_acc)
    return Curve(f"merge_{method}", "weights", [Point(0, {r: m[f"retention/{r}"] for r in routes}, seconds=seconds)])
