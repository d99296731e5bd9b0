"""Faults inside the process, for real (tests/faults injects them; nothing under test is mocked): non-finite losses
are skipped, counted and then stop the merge with its last checkpoint intact; a specialist that keeps failing loses
none of the others and a transient failure is retried; a sharded (FSDP) merge that failed resumes from its
checkpoint to the weights of a merge that never stopped. In-process flows on the short pipeline's models
(tests/conftest.py). Run: python -m pytest tests/test_faults.py -q -s
"""

import json
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from tasks.training.checkpoint import checkpoints_dir
from tasks.tracking.runs import tracking_uri
from tests.faults import InjectedFault

pytestmark = pytest.mark.e2e


@pytest.fixture(autouse=True)
def _fresh_fault_counts(monkeypatch):
    """Fault rules count hits per process and only restart when $OPD_FAULT changes (tests/faults): two tests in a row
    with the same rule would share its counts, and the second would inject nothing where it means to."""
    import tests.faults.rules

    monkeypatch.setattr(tests.faults.rules, "_counts", {})
    monkeypatch.setattr(tests.faults.rules, "_spec_seen", [""])


def tiny_merge(short_pipeline, label: str, **opd):
    """The short pipeline's merge cut to a few steps, no gate, a checkpoint every 2 steps, in its own experiment."""
    cfg, res = short_pipeline
    mcfg = cfg.merge(res["base_uri"], res["teachers"])
    opd = mcfg.opd.model_validate({**mcfg.opd.model_dump(), "steps": 8, "batch_size": 8, "eval_every": 100,
                                   "checkpoint_every": 2, "gate_threshold": 0.0, **opd})
    return mcfg.model_copy(update={"label": label, "experiment": f"faults-{label}", "opd": opd})


def only_run(experiment: str):
    client = MlflowClient(tracking_uri())
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return run


def history(run_id: str, key: str) -> list[tuple[int, float]]:
    ms = MlflowClient(tracking_uri()).get_metric_history(run_id, key)
    return [(m.step, m.value) for m in sorted(ms, key=lambda m: (m.step, m.timestamp))]


def count_updates(monkeypatch) -> list[int]:
    """Count the merge's optimizer updates in this process (the real update runs; one entry per call)."""
    import tasks.merging.merge

    calls, real = [], tasks.merging.merge.update_step

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(tasks.merging.merge, "update_step", counting)
    return calls


def latest_checkpoint(folder: Path) -> tuple[int, dict]:
    latest = folder / (folder / "latest").read_text().strip()
    return json.loads((latest / "state.json").read_text())["step"], load_file(latest / "student.safetensors")


def moved_from(final: dict, weights: dict) -> float:
    """Max abs difference over the tensors both hold (a saved model may drop a tied head)."""
    common = sorted(set(final) & set(weights))
    assert common
    return max((final[k] - weights[k]).abs().max().item() for k in common)


def checkpoint_folder(run_id: str) -> Path:
    (folder,) = [p.parent for p in checkpoints_dir().glob("merge-*/run.json")
                 if json.loads(p.read_text())["run_id"] == run_id]
    return folder


def test_non_finite_steps_are_skipped_counted_then_stop_the_merge_with_its_last_checkpoint_intact(
        short_pipeline, monkeypatch):
    from flows.merge import merge
    from tasks.merging.merge import TooManyBadSteps

    mcfg = tiny_merge(short_pipeline, "nan", max_bad_steps=2)
    monkeypatch.setenv("OPD_FAULT", "loss:3-=nan")  # every loss from the 3rd step on is NaN, through backward
    with pytest.raises(TooManyBadSteps, match=r"3 steps had a non-finite loss or gradient norm, more than "
                                              r"opd.max_bad_steps = 2 \(the last at step 5"):
        merge(mcfg)
    run = only_run("faults-nan")
    run_id = run.info.run_id
    assert run.info.status == "FAILED"
    assert history(run_id, "train/skipped_steps") == [(1, 0.0), (2, 0.0), (3, 1.0), (4, 2.0), (5, 3.0)]
    assert [s for s, _ in history(run_id, "train/loss")] == [1, 2]  # a NaN loss is not logged as a value
    folder = checkpoint_folder(run_id)
    assert (folder / "latest").read_text().strip() == "step-00000004"
    # Steps 3 and 4 were skipped: the checkpoint after them holds step 2's weights and Adam state, all finite.
    w2, w4 = (load_file(folder / f"step-0000000{s}" / "student.safetensors") for s in (2, 4))
    assert all(torch.equal(w2[k], w4[k]) and bool(torch.isfinite(w4[k]).all()) for k in w2)
    o2, o4 = (torch.load(folder / f"step-0000000{s}" / "trainer.pt", weights_only=True)["optimizer"] for s in (2, 4))
    assert all(torch.equal(o2["state"][i]["exp_avg_sq"], o4["state"][i]["exp_avg_sq"]) for i in o2["state"])
    state = json.loads((folder / "step-00000004" / "state.json").read_text())
    assert (state["bad_steps"], state["version"]) == (2, 2)

    monkeypatch.delenv("OPD_FAULT")  # the cause is gone: the same command resumes from step 4
    res = merge(mcfg)
    assert res["run_id"] == run_id
    run = only_run("faults-nan")
    assert run.info.status == "FINISHED"
    assert run.data.metrics["train/skipped_steps"] == 2.0
    assert [s for s, _ in history(run_id, "train/loss")] == [1, 2, 5, 6, 7, 8]
    final = load_file(Path(res["student_uri"]) / "model.safetensors")
    assert all(bool(torch.isfinite(v).all()) for v in final.values())
    assert any(not torch.equal(final[k], w4[k]) for k in final)


def test_a_transient_failure_of_the_merge_task_is_retried_from_its_last_checkpoint(short_pipeline, monkeypatch):
    from flows.merge import merge

    straight = merge(tiny_merge(short_pipeline, "retry-straight", steps=6))
    mcfg = tiny_merge(short_pipeline, "retried", steps=6).model_copy(update={"retries": 1, "retry_delay_seconds": 0})
    monkeypatch.setenv("OPD_FAULT", "update:5=raise")  # an OSError at step 5, once: Prefect retries the task
    updates = count_updates(monkeypatch)
    retried = merge(mcfg)
    run = only_run("faults-retried")
    assert run.info.status == "FINISHED" and retried["run_id"] == run.info.run_id
    # The first attempt made 5 updates (the 5th failed), the retry resumed from step 4 and made steps 5 and 6: 7. No
    # failure would make 6, a retry from scratch 11 (and the same weights: the merge is deterministic).
    assert len(updates) == 5 + 2, len(updates)
    w1, w2 = (load_file(Path(r["student_uri"]) / "model.safetensors") for r in (straight, retried))
    assert all(torch.equal(w1[k], w2[k]) for k in w1)
    assert history(run.info.run_id, "train/loss") == history(straight["run_id"], "train/loss")
    assert [s for s, _ in history(run.info.run_id, "train/loss")] == [1, 2, 3, 4, 5, 6]


def test_a_failing_specialist_loses_no_other_and_a_transient_failure_is_retried(short_pipeline, monkeypatch):
    from flows.specialists import train_specialists
    from teachers.registry import TeacherRegistry

    cfg, res = short_pipeline
    scfg = cfg.specialists(res["base_uri"]).model_copy(update={
        "train": cfg.specialist_train.model_copy(update={"steps": 30}), "retries": 1, "retry_delay_seconds": 0,
        "name_prefix": "flaky"})
    broken, flaky, fine = cfg.world.routes
    client = MlflowClient(tracking_uri())
    exp = client.get_experiment_by_name("opd-specialists").experiment_id

    def attempts() -> dict[str, list[str]]:
        runs = client.search_runs([exp], f"params.steps = '30' and params.base_uri = '{res['base_uri']}'")
        out: dict[str, list[str]] = {}
        for r in sorted(runs, key=lambda r: r.info.start_time):
            out.setdefault(r.data.params["route"], []).append(r.info.status)
        return out

    # One route fails every time (after its training), one only the first time: a transient failure.
    monkeypatch.setenv("OPD_FAULT", f"specialist/{broken}=raise,specialist/{flaky}:1=raise")
    with pytest.raises(RuntimeError, match=rf"1 specialist\(s\) failed \(the 2 others are registered\): "
                                           rf"{broken}: InjectedFault"):
        train_specialists(scfg)
    assert attempts() == {broken: ["FAILED", "FAILED"], flaky: ["FAILED", "FINISHED"], fine: ["FINISHED"]}
    names = set(TeacherRegistry().names())
    assert {f"flaky-{flaky}", f"flaky-{fine}"} <= names and f"flaky-{broken}" not in names

    monkeypatch.delenv("OPD_FAULT")
    assert sorted(train_specialists(scfg)) == sorted(f"flaky-{r}" for r in cfg.world.routes)
    # Only the failed specialist trained again; the others came from the cache.
    assert attempts() == {broken: ["FAILED", "FAILED", "FINISHED"], flaky: ["FAILED", "FINISHED"], fine: ["FINISHED"]}


def test_a_sharded_merge_that_failed_resumes_to_the_weights_of_one_that_never_stopped(short_pipeline, monkeypatch):
    """FSDP (2 gloo ranks): the lead gathers the full weights and optimizer state into the checkpoint; on resume every
    rank loads them and keeps its shard."""
    from flows.merge import merge

    straight = merge(tiny_merge(short_pipeline, "fsdp-straight", nproc=2, steps=6))
    mcfg = tiny_merge(short_pipeline, "fsdp-resumed", nproc=2, steps=6)
    monkeypatch.setenv("OPD_FAULT", "update:5=raise")  # both ranks fail at their 5th update, after the checkpoint 4
    with pytest.raises(InjectedFault, match=r"injected fault at update \(hit 5"):  # rank 0's own, as it is
        merge(mcfg)
    failed = only_run("faults-fsdp-resumed")
    assert failed.info.status == "FAILED"
    ckpt_step, ckpt_weights = latest_checkpoint(checkpoint_folder(failed.info.run_id))
    assert ckpt_step == 4
    # The ranks are torchrun's processes, so updates are counted there: a fault armed at update 6 - 4 + 1 = 3 fires
    # only if a rank makes more than the 2 updates a resume from step 4 needs (steps 5 and 6), i.e. started over.
    monkeypatch.setenv("OPD_FAULT", f"update:{6 - ckpt_step + 1}=raise")
    resumed = merge(mcfg)
    monkeypatch.delenv("OPD_FAULT")
    assert resumed["run_id"] == failed.info.run_id
    assert [s for s, _ in history(resumed["run_id"], "train/loss")] == [1, 2, 3, 4, 5, 6]
    w1, w2 = (load_file(Path(r["student_uri"]) / "model.safetensors") for r in (straight, resumed))
    diff = max((w1[k] - w2[k]).abs().max().item() for k in w1)
    moved = moved_from(w2, ckpt_weights)
    print(f"\nFSDP merge failed at step 5, resumed from step 4: weights moved {moved:.1e} after the checkpoint, max "
          f"abs weight diff vs uninterrupted {diff:.1e}")
    assert moved > 1e-4
    assert diff == 0.0
    # The losses agree to float32 rounding: the student rebuilt from the checkpoint and sharded again computed the
    # first resumed loss 1 ulp apart (seen once) from the same weights; one process is exact (tests/test_resume.py).
    (s1, v1), (s2, v2) = (zip(*history(r["run_id"], "train/loss")) for r in (straight, resumed))
    assert s1 == s2 and v1 == pytest.approx(v2, rel=1e-6, abs=0)
    assert resumed["rows"] == straight["rows"]
