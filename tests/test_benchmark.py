"""The method benchmark: its bookkeeping on hand-made curves (cost to a target, ratios, short/long split), its
config, and the flow end to end on the quick profile with a few short methods."""

import math

import pytest

from tasks.bench.curves import (
    Curve,
    Point,
    curve_records,
    first_reaching,
    route_groups,
    summary_metrics,
    summary_rows,
)

ROUTES = ["rev-low", "sort-high", "rev-long"]


def _curve(method, kind, points):
    return Curve(method, kind, [Point(s, dict(zip(ROUTES, ret)), tok, 0.0, scored, sec)
                                for s, ret, tok, scored, sec in points])


def test_cost_to_target_and_ratios_by_hand():
    opd = _curve("opd", "merge", [(0, (0.3, 0.3, 0.0), 0, 0, 0.0), (100, (0.9, 0.9, 0.6), 5000, 6000, 10.0),
                                  (200, (1.0, 1.0, 0.85), 10000, 12000, 20.0)])
    rl = _curve("rl", "rl", [(0, (0.3, 0.3, 0.0), 0, 0, 0.0), (100, (0.5, 0.5, 0.2), 40000, 0, 30.0),
                             (200, (0.7, 0.6, 0.5), 80000, 0, 60.0)])
    merged = _curve("ties", "weights", [(0, (0.6, 0.5, 0.1), 0, 0, 1.0)])
    assert route_groups(ROUTES) == {"short": ["rev-low", "sort-high"], "long": ["rev-long"]}
    assert first_reaching(opd, 0.9).step == 200  # mean at 100 is 0.8, at 200 0.95
    assert first_reaching(rl, 0.9) is None
    headers, rows = summary_rows([opd, rl, merged], ROUTES, 0.9, "opd")
    by = {r[0]: dict(zip(headers, r)) for r in rows}
    assert by["opd"]["final mean"] == pytest.approx(0.95)
    assert by["opd"]["final short"] == pytest.approx(1.0) and by["opd"]["final long"] == pytest.approx(0.85)
    assert by["opd"]["reached 0.9"] == "yes" and by["opd"]["steps"] == 200
    assert by["opd"]["student tok"] == 10000 and by["opd"]["teacher scored tok"] == 12000
    assert by["opd"]["steps / opd"] == 1.0
    # RL never reaches 0.9: its best evaluation (step 200, mean 0.6) stands in, with its cost.
    assert by["rl"]["reached 0.9"] == "best" and by["rl"]["best mean"] == pytest.approx(0.6)
    assert by["rl"]["student tok / opd"] == pytest.approx(8.0) and by["rl"]["train s"] == 60.0
    assert by["ties"]["steps / opd"] == 0.0 and by["ties"]["student tok / opd"] == 0.0
    records = curve_records([opd, merged])
    assert len(records) == 4 and records[2]["retention/rev-long"] == 0.85 and records[2]["student_tokens"] == 10000
    assert records[3] == {"method": "ties", "kind": "weights", "step": 0, "student_tokens": 0,
                          "teacher_sampled_tokens": 0.0, "teacher_scored_tokens": 0, "train_seconds": 1.0,
                          "mean": pytest.approx(0.4), "retention/rev-low": 0.6, "retention/sort-high": 0.5,
                          "retention/rev-long": 0.1}
    m = summary_metrics(headers, rows)
    assert m["final_mean/opd"] == pytest.approx(0.95) and m["student_tok_over_opd/rl"] == pytest.approx(8.0)
    assert all(math.isfinite(v) for v in m.values()) and not any(k.startswith("reached") for k in m)


def test_benchmark_config_adds_the_long_routes_and_matches_grpo_to_the_merges():
    from flows.bench.benchmark import benchmark_config

    cfg = benchmark_config("quick")
    assert cfg.world.routes == ["rev-low", "rev-high", "sort-low", "rev-long", "sort-long"]
    assert cfg.world.lengths("rev-long") == (5, 6)
    assert cfg.opd.gate_threshold == 0.5
    cfg = benchmark_config("quick", opd={"steps": 77, "eval_every": 11, "batch_size": 32})
    rl = cfg.grpo()
    assert (rl.steps, rl.eval_every, rl.prompts_per_step, rl.group_size) == (77, 11, 32, 8)
    assert benchmark_config("quick", rl_follows_opd=False).grpo().steps == cfg.rl.steps
    with pytest.raises(ValueError, match="unknown methods"):
        benchmark_config("quick", methods=["opd_reverse_kl", "dpo"])


def test_the_benchmark_on_the_real_profile_keeps_its_spec_its_cold_start_and_its_gate():
    """The alternatives to OPD on the real profile start as its merge does (30 steps on the routes' references, the
    gate at 0.8): its base answers in sentences. No built-in long routes are added to a spec's profile."""
    from flows.bench.benchmark import benchmark_config
    from tasks.config import pipeline_config

    cfg, real = benchmark_config("real"), pipeline_config("real")
    assert cfg.spec == real.spec and cfg.world.routes == real.world.routes
    assert (cfg.opd.cold_start_steps, cfg.opd.gate_threshold) == (real.opd.cold_start_steps, real.opd.gate_threshold)
    assert cfg.opd.cold_start_steps == 120


@pytest.mark.e2e
def test_benchmark_flow_end_to_end_on_the_quick_profile(prefect_server):
    """Every kind of method, briefly, from one base: two merges (on-policy reverse KL, off-policy SFT), GRPO, a
    weight merge and ExOPD from RL specialists at two reward scales; the table, the curves and their costs."""
    from mlflow.tracking import MlflowClient

    from flows.bench.benchmark import benchmark, benchmark_config

    cfg = benchmark_config(
        "quick", methods=["opd_reverse_kl", "sft_teacher_samples", "grpo_mix_rl", "merge_ties", "exopd_rl"],
        world={"eval_size": 30}, base_train={"steps": 120}, specialist_train={"steps": 60}, min_accuracy=0.0,
        opd={"steps": 12, "eval_every": 6, "batch_size": 16, "gate_threshold": 0.0, "pass_k": 0},
        rl={"group_size": 4, "prompts_per_step": 4},
        rl_specialist={"steps": 4, "prompts_per_step": 4, "group_size": 4, "eval_every": 4},
        exopd_scales=[1.0, 2.0])
    out = benchmark(cfg)
    curves = {c.method: c for c in out["curves"]}
    assert list(curves) == ["opd_reverse_kl", "sft_teacher_samples", "grpo_mix_rl", "merge_ties", "exopd_rl_x1",
                            "exopd_rl_x2"]
    assert [r[0] for r in out["rows"]] == list(curves)
    opd, sft, grpo = curves["opd_reverse_kl"], curves["sft_teacher_samples"], curves["grpo_mix_rl"]
    assert [p.step for p in opd.points] == [0, 6, 12] and [p.step for p in grpo.points] == [0, 6, 12]
    # On-policy: the student samples and the teachers score; off-policy SFT: the teachers sample, the student never.
    assert 0 < opd.points[1].student_tokens < opd.points[2].student_tokens and opd.final.teacher_sampled_tokens == 0
    assert sft.final.student_tokens == 0 and sft.final.teacher_sampled_tokens > 0
    assert opd.final.teacher_scored_tokens > 0 and grpo.final.teacher_scored_tokens == 0
    assert grpo.final.student_tokens >= 12 * 16  # 12 steps of 16 samples (4 prompts x 4), each at least its EOS
    assert len(curves["merge_ties"].points) == 1 and curves["merge_ties"].final.student_tokens == 0
    # ExOPD's reference model scores every sequence too: scale 2 costs more teacher-side tokens than scale 1.
    x1, x2 = curves["exopd_rl_x1"].final, curves["exopd_rl_x2"].final
    assert x2.teacher_scored_tokens > x1.teacher_scored_tokens
    for c in curves.values():
        for p in c.points:
            assert all(0.0 <= v <= 10.0 for v in p.retention.values()), (c.method, p)
    assert set(out["exopd"]) == {"exopd_rl_x1", "exopd_rl_x2"}
    client = MlflowClient()
    run = client.get_run(out["summary_run_id"])
    assert {"benchmark.json", "retention_by_route.json", "curves.json", "retention_curves.png", "exopd.json"} <= {
        a.path for a in client.list_artifacts(out["summary_run_id"])}
    assert run.data.metrics["final_mean/opd_reverse_kl"] == pytest.approx(opd.final.mean())
    assert "sft_teacher_samples" in run.data.params["methods"]
