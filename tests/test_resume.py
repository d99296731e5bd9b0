"""Resume after a kill, for real. The merge command (``python -m flows.merge``) is killed with SIGKILL at three points
(during generation, during the update, during a checkpoint write: tests/faults makes the process kill itself
there), then the same command runs again: it resumes from its last checkpoint into the same MLflow run and ends with
exactly the weights and metrics of a merge never interrupted. When the MLflow server goes down mid-merge, the merge
stops with a clear error before doing more work, and the same command resumes once the server is back.

Tiny merges on the short pipeline's models (tests/conftest.py): a 4-step off-policy cold start on teacher samples,
the gate, 10 steps of GKD with lambda 0.5 (the student's rollouts and cached teacher samples mixed), a checkpoint
every 3 steps. Run: python -m pytest tests/test_resume.py -q -s
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from tasks.training.checkpoint import checkpoints_dir
from tasks.tracking.runs import tracking_uri
from tests.test_faults import _fresh_fault_counts, count_updates, latest_checkpoint, moved_from  # noqa: F401

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
MERGE = {"opd.steps": 10, "opd.cold_start_steps": 4, "opd.batch_size": 8, "opd.lmbda": 0.5, "opd.warmup_steps": 2,
         "opd.checkpoint_every": 3, "opd.eval_every": 6, "opd.gate_threshold": 0.01}
TOTAL_STEPS = MERGE["opd.cold_start_steps"] + MERGE["opd.steps"]  # optimizer steps, counted across both stages
TIMEOUT_S = 300
# The least max abs weight change a resumed merge must make after its checkpoint (a few AdamW steps move the tiny
# student's weights by ~1e-3 or more; a merge that stopped at its checkpoint moves them by exactly 0).
MOVED = 1e-4


def merge_command(short_pipeline, label: str) -> list[str]:
    _, res = short_pipeline
    args = {"student_uri": res["base_uri"], "teachers": json.dumps(res["teachers"]), "experiment": f"resume-{label}",
            "label": label, **MERGE}
    return [sys.executable, "-m", "flows.merge", "--profile", "quick",
            *[x for k, v in args.items() for x in (f"--{k}", str(v))]]


def run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env={**env, "COLUMNS": "400"}, cwd=ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def merge_runs(experiment: str, uri: str | None = None) -> list:
    client = MlflowClient(uri or tracking_uri())
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id]) if exp else []


def histories(run_id: str, uri: str | None = None) -> dict[str, list[tuple[int, float]]]:
    """Every metric's full history, (step, value) in logging order, duplicates kept; timings (wall clock, never the
    same twice) left out."""
    client = MlflowClient(uri or tracking_uri())
    return {key: [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key),
                                                    key=lambda m: (m.step, m.timestamp))]
            for key in client.get_run(run_id).data.metrics if not key.startswith("time/")}


def student_weights(run) -> dict:
    return load_file(Path(run.data.tags["merged_student_uri"]) / "model.safetensors")


def max_abs_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def checkpoint_folder(run_id: str) -> Path:
    (folder,) = [p.parent for p in checkpoints_dir().glob("merge-*/run.json")
                 if json.loads(p.read_text())["run_id"] == run_id]
    return folder


def tripwire(steps_left: int) -> dict[str, str]:
    """The environment of a resumed command: a fault at one update more than the steps left after its checkpoint.
    A merge that ignored its checkpoint and started over in the same run would end with the same weights and metric
    histories (it is deterministic, and values MLflow already holds are not logged twice): this makes it fail."""
    return {"OPD_FAULT": f"update:{steps_left + 1}=raise"}


def assert_resumed_ok(proc: subprocess.CompletedProcess) -> None:
    out = proc.stdout + proc.stderr
    assert "injected fault at update" not in out, ("the resumed merge made more updates than the steps left after its "
                                                   "checkpoint: it started over\n" + out[-4000:])
    assert proc.returncode == 0, out[-4000:]


def assert_trained_past(run, step: int, weights: dict, total: int = TOTAL_STEPS, uri: str | None = None) -> float:
    """The resumed run went on from its checkpoint (``step``, ``weights``) to the merge's last step: every step's loss
    is in MLflow, once, and the student it ended with is not the checkpoint's. Returns the max abs weight change."""
    steps = [s for s, _ in histories(run.info.run_id, uri)["train/loss"]]
    assert step < total and steps == list(range(1, total + 1)), (step, total, steps)
    moved = moved_from(student_weights(run), weights)
    assert moved > MOVED, f"the resumed merge ended {moved:.1e} from its step-{step} checkpoint: it did not train on"
    return moved


def assert_same_merge(run, reference, uri: str | None = None) -> float:
    """The run finished with the reference's weights and metric histories; returns the max abs weight difference."""
    assert run.info.status == "FINISHED"
    diff = max_abs_diff(student_weights(run), student_weights(reference))
    assert diff == 0.0
    mine, theirs = histories(run.info.run_id, uri), histories(reference.info.run_id)
    assert sorted(mine) == sorted(theirs)
    for key in theirs:
        assert mine[key] == theirs[key], key
    done = json.loads((checkpoint_folder(run.info.run_id) / "done.json").read_text())
    assert done["run_id"] == run.info.run_id
    assert not list(checkpoint_folder(run.info.run_id).glob("step-*"))  # a finished merge keeps no checkpoints
    return diff


@pytest.fixture(scope="module")
def reference(short_pipeline, flow_env):
    """The same merge, never interrupted."""
    t0 = time.perf_counter()
    proc = run(merge_command(short_pipeline, "straight"), flow_env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (ref,) = merge_runs("resume-straight")
    print(f"\nuninterrupted merge: {time.perf_counter() - t0:.1f}s")
    return ref


@pytest.mark.parametrize("point", ["generate:3", "update:8", "checkpoint_write:3"])
def test_a_merge_killed_anywhere_resumes_into_the_same_run_with_identical_weights_and_metrics(
        short_pipeline, flow_env, reference, point):
    label = "kill-" + point.split(":")[0].replace("_", "-")
    cmd = merge_command(short_pipeline, label)
    killed = run(cmd, {**flow_env, "OPD_FAULT": f"{point}=kill"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-4000:]
    (before,) = merge_runs(f"resume-{label}")
    assert before.info.status == "RUNNING"  # SIGKILL: nothing could mark it
    folder = checkpoint_folder(before.info.run_id)
    latest = (folder / "latest").read_text().strip()
    last_logged = max(s for s, _ in histories(before.info.run_id)["train/loss"])
    ckpt_step, ckpt_weights = latest_checkpoint(folder)
    assert ckpt_step <= last_logged < TOTAL_STEPS, (ckpt_step, last_logged)  # killed mid-merge, after a checkpoint
    if point.startswith("checkpoint_write"):
        (half,) = folder.glob(".tmp-*")  # the half-written checkpoint: never picked up
        assert not (half / "state.json").exists() and latest < half.name[len(".tmp-"):]
    t0 = time.perf_counter()
    resumed = run(cmd, {**flow_env, **tripwire(TOTAL_STEPS - ckpt_step)})
    assert_resumed_ok(resumed)
    (after,) = merge_runs(f"resume-{label}")  # the same run, not a second one
    assert after.info.run_id == before.info.run_id
    assert after.data.tags["resumed_from"] == latest  # the tag names the checkpoint; the tripwire shows it resumed
    moved = assert_trained_past(after, ckpt_step, ckpt_weights)
    diff = assert_same_merge(after, reference)
    print(f"\nkilled at {point} (last step logged {last_logged}), resumed from {latest} in "
          f"{time.perf_counter() - t0:.1f}s: weights moved {moved:.1e} after the checkpoint, max abs weight diff vs "
          f"uninterrupted {diff:.1e}, metric histories equal")


# ------------------------------------------------------------------------------------------------ MLflow outage


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_mlflow(root: Path, port: int) -> subprocess.Popen:
    """``mlflow server`` on a sqlite store under ``root`` (job execution off: ~500 MiB instead of 1.7 GiB)."""
    log = open(root / "mlflow-server.log", "a")
    server = subprocess.Popen(
        ["mlflow", "server", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination",
         str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, stdout=log, stderr=log,
        start_new_session=True, cwd=root)
    import urllib.request

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return server
        except OSError:
            assert server.poll() is None, (root / "mlflow-server.log").read_text()[-3000:]
            time.sleep(1)
    stop_mlflow(server)
    raise TimeoutError("mlflow server did not become healthy in 180 s")


def stop_mlflow(server: subprocess.Popen) -> None:
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def test_mlflow_down_mid_merge_stops_it_clearly_and_the_same_command_resumes(short_pipeline, flow_env, reference,
                                                                               tmp_path):
    """The chosen behaviour: MLflow's own HTTP retries (few here, through its MLFLOW_HTTP_REQUEST_* variables), then
    a clear failure before any more work; no buffering. Nothing is lost: the last checkpoint is older than every
    metric that did not reach MLflow, so the same command redoes and logs them. "Before any more work" is checked by
    what the merge did, not by a wall time: a fault rule at step 5's update would have raised had it trained on, no
    metric past step 3 reached the store, no checkpoint after step 3 was written."""
    port = _free_port()
    uri = f"http://127.0.0.1:{port}"
    env = {**flow_env, "MLFLOW_TRACKING_URI": uri, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
           "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
    cmd = merge_command(short_pipeline, "mlflow-down")
    server = start_mlflow(tmp_path, port)
    try:
        log = open(tmp_path / "merge.log", "w")
        # Stop right after the first checkpoint (step 3); the update of step 5 is a tripwire: the merge must never
        # get there with MLflow down.
        proc = subprocess.Popen(cmd, env={**env, "OPD_FAULT": "checkpoint_saved:1=stop,update:5=raise",
                                          "COLUMNS": "400"}, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + TIMEOUT_S
        while not _stopped(proc.pid):  # it stops itself right after its first checkpoint
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "merge.log").read_text()[-4000:]
            time.sleep(0.2)
        stop_mlflow(server)
        os.kill(proc.pid, signal.SIGCONT)
        proc.wait(timeout=TIMEOUT_S)  # a bound on the wait, not the behaviour under test
        out = (tmp_path / "merge.log").read_text()
        assert "injected fault at update (hit 5" not in out, "the merge trained on to step 5 with MLflow down"
        assert proc.returncode == 1, out[-4000:]
        assert "TrackingUnavailable: MLflow at " + uri + " did not take the metrics of step 4" in out, out[-4000:]
        assert "its last checkpoint (step 3" in out and "run the same command again" in out
        assert "checkpoint at step 6" not in out, out[-4000:]
        folder = Path(re.search(r"checkpoint at step 3 in [\d.]+s: (\S+)", out)[1]).parent
        assert (folder / "latest").read_text().strip() == "step-00000003"
        assert sorted(p.name for p in folder.glob("step-*")) == ["step-00000003"]
        ckpt_step, ckpt_weights = latest_checkpoint(folder)
        print(f"\nMLflow down after step 3: the merge failed at step 4 with TrackingUnavailable, "
              f"checkpoint {folder.name}/step-00000003 intact")
        server = start_mlflow(tmp_path, port)
        # What reached the store before the outage: steps 1-3, nothing later (no buffered metrics flushed after).
        run_id = json.loads((folder / "run.json").read_text())["run_id"]
        stored = histories(run_id, uri)
        assert [s for s, _ in stored["train/loss"]] == [1, 2, 3], stored["train/loss"]
        assert max(s for h in stored.values() for s, _ in h) == 3, {k: h[-1] for k, h in stored.items()}
        resumed = run(cmd, {**env, **tripwire(TOTAL_STEPS - ckpt_step)})
        assert_resumed_ok(resumed)
        (after,) = merge_runs("resume-mlflow-down", uri)
        assert after.info.run_id == json.loads((folder / "run.json").read_text())["run_id"]
        assert after.data.tags["resumed_from"] == "step-00000003"
        moved = assert_trained_past(after, ckpt_step, ckpt_weights, uri=uri)
        diff = assert_same_merge(after, reference, uri)
        print(f"resumed once MLflow was back: weights moved {moved:.1e} after the checkpoint, max abs weight diff vs "
              f"uninterrupted {diff:.1e}, metric histories equal")
    finally:
        stop_mlflow(server)


# ------------------------------------------------------------------- state beyond the weights, in-process


def test_a_resumed_merge_keeps_the_batch_generated_ahead_reused_rollouts_and_the_teacher_pool(short_pipeline,
                                                                                               monkeypatch):
    """Overlapped generation (a batch generated ahead while the update runs), rollout reuse (2 updates per batch),
    one resident teacher of three (evicted and reloaded every step) and retention-driven route sampling (shares
    remeasured every 3 steps): a merge that failed at its 7th update resumes from its step-4 checkpoint (checkpoints
    wait for a batch boundary) to the weights and metrics of one that never stopped."""
    from flows.merge import merge
    from tests.faults import InjectedFault

    cfg, res = short_pipeline

    def config(label: str):
        mcfg = cfg.merge(res["base_uri"], res["teachers"])
        opd = mcfg.opd.model_validate({**mcfg.opd.model_dump(), "steps": 10, "batch_size": 8, "eval_every": 5,
                                       "checkpoint_every": 3, "gate_threshold": 0.0, "overlap_generation": True,
                                       "updates_per_batch": 2, "max_resident_teachers": 1,
                                       "route_sampling": "retention", "route_sampling_every": 3,
                                       "route_sampling_prompts": 8})
        return mcfg.model_copy(update={"label": label, "experiment": f"resume-{label}", "opd": opd})

    straight = merge(config("ahead-straight"))
    monkeypatch.setenv("OPD_FAULT", "update:7=raise")
    with pytest.raises(InjectedFault):
        merge(config("ahead-resumed"))
    (failed,) = merge_runs("resume-ahead-resumed")
    folder = checkpoint_folder(failed.info.run_id)
    assert (folder / "latest").read_text().strip() == "step-00000004"
    import torch

    trainer = torch.load(folder / "step-00000004" / "trainer.pt", weights_only=True)
    ckpt_step, ckpt_weights = latest_checkpoint(folder)
    # The batch for steps 5 and 6, generated ahead during steps 3 and 4 by the student of step 2.
    assert trainer["pending"]["version"] == 2
    monkeypatch.delenv("OPD_FAULT")
    updates = count_updates(monkeypatch)
    resumed = merge(config("ahead-resumed"))
    assert resumed["run_id"] == failed.info.run_id
    assert len(updates) == 10 - ckpt_step, len(updates)  # the steps after the checkpoint only: resumed, not started over
    (ref,) = merge_runs("resume-ahead-straight")
    (after,) = merge_runs("resume-ahead-resumed")
    assert after.info.run_id == failed.info.run_id and ref.info.run_id == straight["run_id"]
    opd = config("ahead-resumed").opd
    moved = assert_trained_past(after, ckpt_step, ckpt_weights, total=opd.cold_start_steps + opd.steps)
    diff = assert_same_merge(after, ref)
    hist = histories(ref.info.run_id)
    assert hist["teachers/evictions"][-1][1] > 0
    # The shares every step was drawn with, from the slice measured at steps 0, 3, 6, 9: a route with more need has a
    # larger share, and the shares changed during the merge.
    routes = [k.split("/", 1)[1] for k in hist if k.startswith("route_share/")]
    assert len(routes) == 3 and all([s for s, _ in hist[f"route_share/{r}"]] == list(range(1, 11)) for r in routes)
    for step in (0, 3, 6, 9):
        need = {r: dict(hist[f"route_sampling/need/{r}"])[step] for r in routes}
        share = {r: dict(hist[f"route_share/{r}"])[step + 1] for r in routes}
        assert sum(share.values()) == pytest.approx(1.0) and min(share.values()) >= 0.5 / 3 - 1e-9
        assert sorted(routes, key=need.get) == sorted(routes, key=share.get) or len(set(need.values())) < 3, (need,
                                                                                                             share)
    assert len({tuple(dict(hist[f"route_share/{r}"])[s] for r in routes) for s in (1, 4, 7, 10)}) > 1
    print(f"\noverlap + reuse + 1 resident teacher, failed at step 7, resumed from step 4: weights moved {moved:.1e} "
          f"after the checkpoint, max abs weight diff {diff:.1e}, metric histories equal")
