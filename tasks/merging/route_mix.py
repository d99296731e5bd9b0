"""Retention-driven route sampling (``opd.route_sampling retention``): each batch's prompts are spread over the
routes in proportion to what each route still lacks, instead of uniformly.

Every ``opd.route_sampling_every`` steps the merge measures the student on a slice of each route's training prompts
that it never trains on (``opd.route_sampling_prompts`` per route, :func:`hold_out`), against its teacher on the same
slice (measured once, at the start), and turns that into shares:

    need_r  = clip(1 - student_r / teacher_r, 0, 1)                 (1 - retention on the slice)
    smooth  = s * need_prev_r + (1 - s) * need_r                   (s = opd.route_sampling_smoothing; the first: need_r)
    share_r = f / R + (1 - f) * smooth_r / sum(smooth)             (f = opd.route_sampling_floor; uniform if all 0)

so every route keeps at least ``f / R`` of each batch (none starves, and a route that is kept is still rehearsed)
and the rest goes where retention is lowest. The slice is carved from the training split, not the evaluation
split: the held-out prompts that retention is reported on never steer training.
"""

from __future__ import annotations

from collections.abc import Mapping

from tasks.evaluation.evaluate import retention

Sets = dict[str, tuple[list[str], list[str]]]


def hold_out(train: Sets, n: int) -> tuple[Sets, Sets]:
    """``(train without the slice, the slice)``: the last ``n`` prompts of each route (at most a quarter of them, so
    a small route keeps three quarters of its prompts to train on)."""
    kept: Sets = {}
    held: Sets = {}
    for route, (prompts, answers) in train.items():
        k = min(n, len(prompts) // 4)
        if k < 1:
            raise ValueError(f"route {route!r} has {len(prompts)} training prompt(s): opd.route_sampling retention "
                             "holds out a slice of at least one prompt and keeps three quarters to train on, so it "
                             "needs at least 4; use opd.route_sampling uniform or add prompts")
        cut = len(prompts) - k
        kept[route], held[route] = (prompts[:cut], answers[:cut]), (prompts[cut:], answers[cut:])
    return kept, held


def route_need(student_acc: Mapping[str, float], teacher_acc: Mapping[str, float]) -> dict[str, float]:
    """What each route still lacks: ``1 - retention`` clipped to [0, 1] (a route the student already does as well as
    its teacher needs nothing; a teacher that scores 0 on the slice gives no signal: need 0)."""
    return {r: min(max(1.0 - retention(s, teacher_acc[r]), 0.0), 1.0) if teacher_acc[r] > 0 else 0.0
            for r, s in student_acc.items()}


def smooth_need(previous: Mapping[str, float], new: Mapping[str, float], smoothing: float) -> dict[str, float]:
    """Exponential smoothing across measurements: ``smoothing * previous + (1 - smoothing) * new``; a route with no
    previous value takes its new one."""
    return {r: smoothing * previous[r] + (1.0 - smoothing) * v if r in previous else v for r, v in new.items()}


def route_shares(need: Mapping[str, float], floor: float) -> dict[str, float]:
    """Each route's share of a batch: ``floor / R`` for every route plus ``1 - floor`` split in proportion to need
    (uniform when no route needs anything). Shares sum to 1."""
    if not need:
        raise ValueError("route shares over no routes")
    if not 0.0 <= floor <= 1.0:
        raise ValueError(f"floor {floor} is not in [0, 1]")
    n, total = len(need), sum(need.values())
    if total <= 0:
        return {r: 1.0 / n for r in need}
    return {r: floor / n + (1.0 - floor) * v / total for r, v in need.items()}
