"""Restoration (tasks/merging/restore.py, flows/restore.py): after merge k of a chain, a route the student lost gets
the best earlier checkpoint of the chain (or the base) as its teacher in merge k+1. The plan on hand-made chains,
the teachers of the next merge, and the chain read back from MLflow runs."""

import pytest

from tasks.merging.restore import ChainRun, next_teachers, read_chain, restoration_plan


def run(run_id, accuracy, retention, base=None, teachers=("t-a", "t-b", "t-c")):
    return ChainRun(run_id, f"/start/{run_id}", f"/merged/{run_id}", list(teachers), accuracy, base or {}, retention)


def test_a_lost_route_gets_the_best_earlier_checkpoint_and_kept_routes_keep_their_teacher():
    r1 = run("r1", {"a": 0.90, "b": 0.80, "c": 0.50}, {"a": 0.95, "b": 0.85, "c": 0.55},
             base={"a": 0.20, "b": 0.30, "c": 0.60})
    r2 = run("r2", {"a": 0.95, "b": 0.40, "c": 0.55}, {"a": 1.00, "b": 0.42, "c": 0.58})
    r3 = run("r3", {"a": 0.30, "b": 0.85, "c": 0.52}, {"a": 0.32, "b": 0.89, "c": 0.55})
    plan = restoration_plan([r1, r2, r3], 0.9)
    # a: lost in r3 (0.30); r2's student had it best (0.95). b: retained 0.89 < 0.9, but no earlier checkpoint beat
    # r3's 0.85 (r1 0.80, r2 0.40, base 0.30): kept. c: the base (0.60) beats every merge on it.
    assert set(plan) == {"a", "c"}
    assert (plan["a"].source, plan["a"].uri, plan["a"].accuracy, plan["a"].lost) == ("r2", "/merged/r2", 0.95, 0.30)
    assert (plan["c"].source, plan["c"].uri, plan["c"].accuracy) == ("base", "/start/r1", 0.60)
    assert restoration_plan([r1, r2, r3], 0.3) == {}  # nothing retained below 0.3
    # Ties go to the latest checkpoint.
    tie = restoration_plan([r1, run("r2", {"a": 0.90}, {"a": 0.9}), run("r3", {"a": 0.1}, {"a": 0.1})], 0.5)
    assert tie["a"].source == "r2"
    with pytest.raises(ValueError, match="at least one"):
        restoration_plan([], 0.9)


def test_the_next_merge_replaces_only_the_restored_routes_teachers():
    last = run("r3", {}, {}, teachers=("t-a", "t-b", "t-c"))
    plan = restoration_plan([run("r1", {"a": 0.9}, {"a": 1.0}), run("r3", {"a": 0.1}, {"a": 0.1})], 0.9)
    names = next_teachers(last, plan, {"t-a": "a", "t-b": "b", "t-c": "c"}, {"a": "restore-a-r1"})
    assert names == ["t-b", "t-c", "restore-a-r1"]


def test_the_chain_is_read_from_each_merge_runs_tags_and_per_route_metrics(tmp_path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.create_experiment("chain")
    done = client.create_run(exp).info.run_id
    for k, v in {"accuracy/a": 0.7, "accuracy/b": 0.5, "base_accuracy/a": 0.1, "retention/a": 0.8,
                 "accuracy/a/t-a": 0.99, "teacher_accuracy/a": 0.875}.items():
        client.log_metric(done, k, v)
    for k, v in {"student_uri": "/base", "merged_student_uri": "/merged/1", "teachers": "t-a,t-b"}.items():
        client.set_tag(done, k, v)
    (got,) = read_chain([done], client)
    assert got == ChainRun(done, "/base", "/merged/1", ["t-a", "t-b"], {"a": 0.7, "b": 0.5}, {"a": 0.1}, {"a": 0.8})
    unfinished = client.create_run(exp).info.run_id
    with pytest.raises(ValueError, match="no merged student"):
        read_chain([done, unfinished], client)
