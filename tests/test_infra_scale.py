"""The scale-out files in infra/scale/ and the GPU check (infra/gpu-check.sh) cannot run here for real (no docker
engine, no Kubernetes cluster, no Slurm, no GPU). They are parsed and checked for what this project promises:
loopback-only published ports, no secret in the files, the same work-pool and tracking wiring as the local stack,
pinned torch, image versions matching the installed packages, every YAML parsing and every script passing `bash -n`.
The scripts' logic runs with stand-ins for python, torchrun, srun and scontrol, and every command they would start is
parsed by the flow's own command line (a flag the CLI does not accept fails the test)."""

import importlib
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest
import torch
import yaml

from tasks.common.paths import PROJECT_ROOT
from tasks.training.launch import torchrun_args

SCALE = PROJECT_ROOT / "infra" / "scale"
GPU_CHECK = PROJECT_ROOT / "infra" / "gpu-check.sh"
NODE = SCALE / "merge-node.sh"


def test_compose_stack_publishes_only_on_loopback_and_wires_the_worker():
    doc = yaml.safe_load((SCALE / "docker-compose.yaml").read_text())
    services = doc["services"]
    assert {"postgres", "prefect-server", "mlflow", "worker"} <= set(services)
    for name, svc in services.items():
        for port in svc.get("ports", []):
            assert port.startswith("127.0.0.1:"), (name, port)
    env = services["worker"]["environment"]
    assert env["PREFECT_API_URL"] == "http://prefect-server:4200/api"
    assert env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    assert env["OPD_WORK_POOL"] in services["worker"]["command"]
    assert services["mlflow"]["image"].endswith(f"v{mlflow.__version__}")
    assert services["prefect-server"]["image"].startswith("prefecthq/prefect:3")


def test_no_secret_is_written_in_the_files():
    text = (SCALE / "docker-compose.yaml").read_text()
    assert "${OPD_PG_PASSWORD" in text
    assert not re.search(r"PASSWORD:\s*[A-Za-z0-9]", text), "a literal password"
    assert not re.search(r"postgres(ql)?(\+asyncpg)?://opd:[^$]", text), "a literal password in a URL"


def test_image_pins_torch_before_the_project():
    lines = (SCALE / "Dockerfile").read_text().splitlines()
    torch = next(i for i, line in enumerate(lines) if "torch==" in line)
    project = next(i for i, line in enumerate(lines) if 'pip install' in line and '-e ".[ray]"' in line)
    assert torch < project


def ray_manifests() -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all((SCALE / "ray-cluster.yaml").read_text())}


def test_ray_cluster_manifest_is_a_kuberay_cluster_for_the_project_image():
    doc = ray_manifests()["RayCluster"]
    assert doc["apiVersion"] == "ray.io/v1"
    head = doc["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    images = {c["image"] for c in head["template"]["spec"]["containers"]}
    for group in doc["spec"]["workerGroupSpecs"]:
        images |= {c["image"] for c in group["template"]["spec"]["containers"]}
    assert images == {"opd-merge:latest"}


def test_ray_pods_share_one_state_folder_at_the_compose_workers_path():
    """A specialist trained on a worker pod is saved under OPD_HOME: every pod must mount the same shared volume there
    (ReadWriteMany), with Prefect's home and results under it as the compose worker has them."""
    manifests = ray_manifests()
    claim = manifests["PersistentVolumeClaim"]
    assert "ReadWriteMany" in claim["spec"]["accessModes"]
    worker_env = compose()["services"]["worker"]["environment"]
    spec = manifests["RayCluster"]["spec"]
    templates = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
    for template in templates:
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        for c in template["spec"]["containers"]:
            env = {e["name"]: e["value"] for e in c["env"]}
            for key in ("OPD_HOME", "PREFECT_HOME", "PREFECT_RESULTS_LOCAL_STORAGE_PATH", "MLFLOW_TRACKING_URI",
                        "PREFECT_API_URL"):
                assert env[key] == worker_env[key], (c["name"], key)
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert env["OPD_HOME"] in mounts, c["name"]
            claim_name = volumes[mounts[env["OPD_HOME"]]]["persistentVolumeClaim"]["claimName"]
            assert claim_name == claim["metadata"]["name"], c["name"]


def compose() -> dict:
    return yaml.safe_load((SCALE / "docker-compose.yaml").read_text())


def test_every_yaml_parses_and_every_script_passes_bash_n():
    infra = PROJECT_ROOT / "infra"
    yamls = sorted([*infra.rglob("*.yaml"), *infra.rglob("*.yml")])
    assert SCALE / "ray-cluster.yaml" in yamls and SCALE / "docker-compose.yaml" in yamls
    for path in yamls:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs and all(isinstance(d, dict) for d in docs), path
    scripts = sorted([*infra.rglob("*.sh"), *infra.rglob("*.sbatch"), *infra.rglob("*.env")])
    assert {GPU_CHECK, NODE, SCALE / "merge.sbatch", SCALE / "cluster.env"} <= set(scripts)
    for path in scripts:
        proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert proc.returncode == 0, (path, proc.stderr)


# --- what the scripts would start, parsed by the flows' own command lines


def flow_config(argv: list[str], monkeypatch):
    """The config ``python ARGV`` (``-m MODULE FLAGS...``) would run with, parsed by that module's own ``main`` with
    its flow (and preflight, which reads the state) replaced: a flag or value its CLI refuses fails the test."""
    assert argv[0] == "-m", argv
    module, flags = argv[1], argv[2:]
    mod = importlib.import_module(module)
    stand_ins = {"flows.pipeline": ("pipeline", "preflight_pipeline"), "flows.merge": ("merge", "preflight_merge"),
                 "flows.bench.trl": ("bench_trl", None)}
    flow, preflight = stand_ins[module]
    monkeypatch.setattr(mod, flow, lambda cfg: cfg)
    if preflight:
        monkeypatch.setattr(mod, preflight, lambda cfg, **kwargs: None)
    try:
        return mod.main(flags)
    except SystemExit as e:  # argparse (an unknown flag) or InvalidConfig (a value the config refuses)
        pytest.fail(f"python -m {module} refuses {shlex.join(flags)}: {e}")


def dry_run(tmp_path) -> tuple[subprocess.CompletedProcess, dict[str, list[str]], dict[str, str]]:
    env = {**os.environ, "GPU_CHECK_HOME": str(tmp_path / "state"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", str(GPU_CHECK), "--dry-run"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    commands, skips = {}, {}
    for line in proc.stdout.splitlines():
        if m := re.fullmatch(r"\[dry-run\] (\w+): would skip: (.*)", line):
            skips[m[1]] = m[2]
        elif m := re.fullmatch(r"\[dry-run\] (\w+): (.*)", line):
            commands[m[1]] = shlex.split(m[2])
    return proc, commands, skips


@pytest.mark.slow
def test_gpu_check_dry_run_prints_commands_the_flows_accept(tmp_path, monkeypatch):
    proc, commands, skips = dry_run(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert set(commands) == {"pipeline", "trl", "vllm"}, proc.stdout
    assert not (tmp_path / "state").exists(), "a dry run writes nothing to the state folder"
    for argv in commands.values():
        assert argv[0] == os.environ.get("PY", "python3"), argv

    pipe = flow_config(commands["pipeline"][1:], monkeypatch)
    assert pipe.profile == "quick"
    for train in (pipe.base_train, pipe.specialist_train):
        assert (train.device, train.dtype) == ("cuda", "bf16")
    assert (pipe.opd.device, pipe.opd.dtype, pipe.opd.teacher_device, pipe.opd.teacher_dtype) == \
        ("cuda", "bf16", "cuda", "bf16")

    merge = flow_config(commands["vllm"][1:], monkeypatch)
    assert (merge.opd.rollout_backend, merge.opd.teacher_backend) == ("vllm", "vllm")
    assert (merge.opd.device, merge.opd.dtype, merge.opd.teacher_device) == ("cuda", "bf16", "cuda")
    assert merge.world == pipe.world, "the vLLM merge must be the pipeline's quick world (its base and teachers)"
    # Four engines (the rollout engine and one per teacher of the quick world) must fit on one GPU together.
    assert merge.opd.vllm_gpu_memory_utilization * (1 + len(merge.world.routes)) < 0.9

    bench = flow_config(commands["trl"][1:], monkeypatch)
    assert (bench.device, bench.dtype) == ("cuda", "bf16")

    if not torch.cuda.is_available():  # this machine: every phase would be skipped, saying why
        assert set(skips) == {"pipeline", "trl", "vllm"}, proc.stdout
        assert all(why.startswith("no GPU: ") and "sees no CUDA GPU" in why for why in skips.values()), skips


def test_the_dry_run_check_fails_on_a_flag_the_cli_does_not_accept(monkeypatch):
    """The guard itself: a misspelt field is refused, not passed over."""
    with pytest.raises(pytest.fail.Exception, match="refuses"):
        flow_config(["-m", "flows.merge", "--profile", "quick", "--opd.devise", "cuda"], monkeypatch)
    with pytest.raises(pytest.fail.Exception, match="refuses"):
        flow_config(["-m", "flows.bench.trl", "--dtype", "fp16"], monkeypatch)


# --- the GPU check's own logic, with a stand-in for python3 (no GPU needed)

FAKE_PY = r"""#!/usr/bin/env bash
# A stand-in for python3: '-' (a script on stdin) is the import probe, answered from $FAKE_PROBE; a flow records its
# arguments and exits with $FAKE_RC_<phase>, after sleeping $FAKE_SLEEP_<phase> seconds.
if [[ "$1" == - ]]; then cat >/dev/null; cat "$FAKE_PROBE"; exit 0; fi
echo "$*" >>"$FAKE_CALLS"
case "$2" in
  flows.pipeline) phase=pipeline ;;
  flows.bench.trl) phase=trl; echo "ours/TRL tokens per second: 256x4x4 1.25x (target >= 1.5x: NOT met)" ;;
  flows.merge) phase=vllm ;;
esac
sleep_var=FAKE_SLEEP_$phase rc_var=FAKE_RC_$phase
sleep "${!sleep_var:-0}"
[[ "${!rc_var:-0}" == 0 ]] || echo "error: config: the $phase phase was told to fail"
exit "${!rc_var:-0}"
"""

MODULES = ["pydantic", "transformers", "tokenizers", "safetensors", "peft", "datasets", "prefect", "mlflow",
           "matplotlib", "math_verify", "trl", "vllm"]


def fake_check(tmp_path, missing=(), **env) -> tuple[subprocess.CompletedProcess, list[str], dict[str, list[str]]]:
    """Run infra/gpu-check.sh with the stand-in python: a GPU and every module present except ``missing``. Returns
    the process, the commands the stand-in ran and the summary's rows (phase -> [result, seconds, detail])."""
    py = tmp_path / "python3"
    py.write_text(FAKE_PY)
    py.chmod(0o755)
    probe = tmp_path / "probe.tsv"
    probe.write_text("gpu\tok\tNVIDIA H100 80GB HBM3, torch 2.11.0+cu130, CUDA 13.0\n" + "".join(
        f"{m}\tmissing\tModuleNotFoundError: No module named '{m}'\n" if m in missing else f"{m}\tok\t1.0\n"
        for m in MODULES))
    calls = tmp_path / "calls.txt"
    calls.touch()
    full_env = {**os.environ, "PY": str(py), "FAKE_PROBE": str(probe), "FAKE_CALLS": str(calls),
                "GPU_CHECK_HOME": str(tmp_path / "state"), **env}
    proc = subprocess.run(["bash", str(GPU_CHECK)], env=full_env, capture_output=True, text=True, timeout=120)
    summary = proc.stdout.split("GPU check summary", 1)[-1].splitlines()
    rows = {}
    for line in summary:
        if m := re.match(r"(env|pipeline|trl|vllm) +(ok|failed|skipped) +(\d+) +(.*)", line):
            rows[m[1]] = [m[2], m[3], m[4]]
    return proc, calls.read_text().splitlines(), rows


def test_gpu_check_passes_when_every_phase_passes(tmp_path):
    proc, calls, rows = fake_check(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {p: r[0] for p, r in rows.items()} == {"env": "ok", "pipeline": "ok", "trl": "ok", "vllm": "ok"}
    assert [c.split()[1] for c in calls] == ["flows.pipeline", "flows.bench.trl", "flows.merge"]
    assert "ours/TRL tokens per second: 256x4x4 1.25x" in proc.stdout.split("GPU check summary", 1)[1]
    assert proc.stdout.rstrip().endswith("GPU check passed: every phase ran")
    assert (tmp_path / "state" / "logs" / "pipeline.log").exists()


def test_gpu_check_skips_the_vllm_phase_without_vllm_and_says_why(tmp_path):
    proc, calls, rows = fake_check(tmp_path, missing={"vllm"})
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert [rows[p][0] for p in ("env", "pipeline", "trl", "vllm")] == ["ok", "ok", "ok", "skipped"]
    assert rows["vllm"][2].startswith("vllm does not import (ModuleNotFoundError: No module named 'vllm')")
    assert not any("flows.merge" in c for c in calls)


def test_gpu_check_reports_a_failed_phase_runs_the_rest_and_exits_1(tmp_path):
    proc, calls, rows = fake_check(tmp_path, missing={"trl"}, FAKE_RC_pipeline="1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert rows["pipeline"][0] == "failed"
    assert "exit 1: error: config: the pipeline phase was told to fail" in rows["pipeline"][2]
    assert rows["trl"][0] == "skipped" and rows["trl"][2].startswith("trl does not import")
    assert rows["vllm"][0] == "skipped" and "pipeline phase's base and teachers" in rows["vllm"][2]
    assert "GPU check FAILED: pipeline" in proc.stdout


def test_gpu_check_stops_a_phase_at_its_time_limit_and_keeps_to_the_budget(tmp_path):
    t0 = time.monotonic()
    proc, calls, rows = fake_check(tmp_path, FAKE_SLEEP_pipeline="60", GPU_CHECK_BUDGET="3", GPU_CHECK_MIN_PHASE="1")
    assert time.monotonic() - t0 < 30, "the phase ran past its limit"
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert rows["pipeline"][0] == "failed" and rows["pipeline"][2].startswith("timed out after ")
    assert rows["trl"][0] == "skipped" and rows["trl"][2].startswith("no time left")
    assert rows["vllm"][0] == "skipped"


def test_gpu_check_installs_carried_wheels_before_it_probes(tmp_path):
    """With a .whl/ folder in the checkout the check installs it (pip --no-index --no-deps --target) and puts the
    target on PYTHONPATH; the dry run says the command. Run in a copy of the script beside an empty .whl/ wheel."""
    root = tmp_path / "repo"
    (root / "infra").mkdir(parents=True)
    (root / "infra" / "gpu-check.sh").write_text(GPU_CHECK.read_text())
    (root / ".whl").mkdir()
    (root / ".whl" / "demo-1.0-py3-none-any.whl").write_bytes(b"")
    env = {**os.environ, "GPU_CHECK_HOME": str(tmp_path / "state"), "PY": "true"}
    proc = subprocess.run(["bash", str(root / "infra" / "gpu-check.sh"), "--dry-run"], env=env, capture_output=True,
                          text=True, timeout=60)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("[dry-run] wheels: "))
    assert "pip install -q --no-index --no-deps" in line and "--target" in line and "(1 wheels)" in line
    assert re.search(r"PYTHONPATH=\S*" + re.escape(str(root)) + r":/tmp/opd-gpu-check-site", proc.stdout), proc.stdout


def test_gpu_check_wheel_list_pins_the_versions_this_environment_runs():
    """The wheels --fetch-wheels carries to a GPU machine are the versions the tests here run with."""
    from importlib.metadata import version

    text = GPU_CHECK.read_text()
    pins = dict(re.findall(r"([A-Za-z0-9_.-]+)==([0-9][^\s\"]*)", text.split("MISSING_ON_CUDA_IMAGE=", 1)[1].split('"\n', 1)[0]))
    for name in ("prefect", "mlflow", "datasets", "pydantic", "pydantic-core", "math-verify"):
        assert pins[name] == version(name), name
    assert "vllm" not in pins and "torch" not in pins


# --- the multi-machine merge: infra/scale/merge-node.sh, merge.sbatch and cluster.env


def stubs(tmp_path) -> tuple[Path, Path]:
    """A python3 stand-in that records its arguments (and, as the head's merge, writes a job the way
    tasks.training.launch does: <OPD_HOME>/jobs/<run id>/job.pkl), and a torchrun stand-in that records its own."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    log.mkdir()
    (bin_dir / "python3").write_text(
        "#!/usr/bin/env bash\nprintf '%s\\n' \"$@\" >\"$STUB_LOG/python3\"\n"
        "sleep 1; mkdir -p \"$OPD_HOME/jobs/run123\" && touch \"$OPD_HOME/jobs/run123/job.pkl\"\n")
    (bin_dir / "torchrun").write_text("#!/usr/bin/env bash\nprintf '%s\\n' \"$@\" >\"$STUB_LOG/torchrun\"\n")
    # scontrol: the first host, a pause, then the rest, as a long node list arrives: a reader that stops after the
    # first line (head -n 1) would end it with SIGPIPE, which pipefail turns into the script's exit (141).
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\necho gpu-node-0; sleep 0.3; echo gpu-node-1\n")
    # srun: one task per node, SLURM_NODEID 0..N-1, each in the background, as Slurm would start them.
    (bin_dir / "srun").write_text(
        "#!/usr/bin/env bash\nwhile [[ $1 == --* ]]; do shift; done\n"
        "for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do SLURM_NODEID=$i \"$@\" & done\n"
        "rc=0; for job in $(jobs -p); do wait $job || rc=1; done; exit $rc\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir, log


def node_env(tmp_path, bin_dir, log, **extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPD_", "SLURM_"))}
    return {**env, "PATH": f"{bin_dir}:{env['PATH']}", "STUB_LOG": str(log), "OPD_HOME": str(tmp_path / "opd"),
            "PY": str(bin_dir / "python3"), "TORCHRUN": str(bin_dir / "torchrun"), **extra}


def test_sbatch_starts_the_head_merge_and_a_torchrun_per_other_node(tmp_path, monkeypatch):
    """merge.sbatch under a stand-in srun (2 nodes x 4 GPUs): node 0 runs the merge with the job's layout, which the
    merge's own CLI accepts; node 1 waits for the job the head writes and runs torchrun exactly as
    tasks.training.launch builds it for every machine."""
    bin_dir, log = stubs(tmp_path)
    env = node_env(tmp_path, bin_dir, log, SLURM_SUBMIT_DIR=str(PROJECT_ROOT), SLURM_JOB_NUM_NODES="2",
                   SLURM_GPUS_ON_NODE="4", SLURM_JOB_NODELIST="gpu-node-[0-1]", SLURM_JOB_ID="77")
    proc = subprocess.run(["bash", str(SCALE / "merge.sbatch"), "--profile", "quick", "--opd.dtype", "bf16"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    head = (log / "python3").read_text().splitlines()
    cfg = flow_config(head, monkeypatch)
    assert (cfg.opd.nnodes, cfg.opd.nproc, cfg.opd.rdzv_endpoint, cfg.opd.dtype) == (2, 8, "gpu-node-0:29500", "bf16")
    job = tmp_path / "opd" / "jobs" / "run123"
    worker = (log / "torchrun").read_text().splitlines()
    assert worker == torchrun_args(job, 4, 2, "gpu-node-0:29500", "run123")
    assert worker[worker.index("-m") + 1] == "tasks.training.launch"
    assert not list((tmp_path / "opd" / "jobs").glob(".slurm-*")), "the marker outlives the job"


def test_a_worker_joins_the_new_job_not_an_older_one(tmp_path):
    bin_dir, log = stubs(tmp_path)
    old = tmp_path / "opd" / "jobs" / "old-run"
    old.mkdir(parents=True)
    (old / "job.pkl").touch()
    os.utime(old / "job.pkl", (time.time() - 3600,) * 2)
    env = node_env(tmp_path, bin_dir, log, OPD_NNODES="3", OPD_NPROC_PER_NODE="2", OPD_RDZV_HOST="10.0.0.5")
    worker = subprocess.Popen(["bash", str(NODE), "worker"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    time.sleep(1.0)
    new = tmp_path / "opd" / "jobs" / "new-run"
    new.mkdir()
    (new / "job.pkl").touch()
    out, _ = worker.communicate(timeout=30)
    assert worker.returncode == 0, out
    assert (log / "torchrun").read_text().splitlines() == torchrun_args(new, 2, 3, "10.0.0.5:29500", "new-run")
    assert not list((tmp_path / "opd" / "jobs").glob(".node-*")), "the worker's marker outlives its wait"


def test_a_worker_gives_up_when_no_job_comes_and_the_head_needs_a_layout(tmp_path):
    bin_dir, log = stubs(tmp_path)
    env = node_env(tmp_path, bin_dir, log, OPD_NNODES="2", OPD_NPROC_PER_NODE="1", OPD_RDZV_HOST="h", OPD_JOB_WAIT="0")
    proc = subprocess.run(["bash", str(NODE), "worker"], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1 and "no job in" in proc.stderr, proc.stdout + proc.stderr
    assert not (log / "torchrun").exists()
    env = node_env(tmp_path, bin_dir, log, OPD_NPROC_PER_NODE="1", OPD_RDZV_HOST="h")  # no OPD_NNODES
    proc = subprocess.run(["bash", str(NODE), "head"], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0 and "OPD_NNODES" in proc.stderr
    assert not (log / "python3").exists()


def cluster_env() -> dict[str, str]:
    """cluster.env's values, sourced by bash in an empty environment (its defaults)."""
    proc = subprocess.run(["env", "-i", "bash", "-c", f"source {shlex.quote(str(SCALE / 'cluster.env'))} && env -0"],
                          capture_output=True, text=True, check=True)
    return dict(item.split("=", 1) for item in proc.stdout.split("\0") if "=" in item)


def test_cluster_env_reaches_the_compose_stack_and_shares_the_state_like_its_worker():
    env, services = cluster_env(), compose()["services"]
    worker = services["worker"]["environment"]
    assert env["OPD_WORK_POOL"] == worker["OPD_WORK_POOL"]
    assert "--port 5000" in services["mlflow"]["command"] and services["mlflow"]["ports"] == ["127.0.0.1:5000:5000"]
    assert "--port 4200" in services["prefect-server"]["command"]
    assert env["MLFLOW_TRACKING_URI"] == f"http://{env['OPD_STACK_HOST']}:5000"
    assert env["PREFECT_API_URL"] == f"http://{env['OPD_STACK_HOST']}:4200/api"
    assert worker["PREFECT_API_URL"].endswith(":4200/api")
    home = env["OPD_HOME"]
    for key in ("PREFECT_HOME", "PREFECT_RESULTS_LOCAL_STORAGE_PATH"):  # the same layout under the state folder
        assert env[key].replace(home, "{home}") == worker[key].replace(worker["OPD_HOME"], "{home}"), key
    assert env["MLFLOW_DISABLE_TELEMETRY"] == worker["MLFLOW_DISABLE_TELEMETRY"]
    assert env["OPD_RDZV_PORT"].isdigit()
    # A value already in the environment wins over the file's default.
    proc = subprocess.run(["env", "-i", "OPD_HOME=/nfs/x", "bash", "-c",
                           f"source {shlex.quote(str(SCALE / 'cluster.env'))} && echo $OPD_HOME $PREFECT_HOME"],
                          capture_output=True, text=True, check=True)
    assert proc.stdout.split() == ["/nfs/x", "/nfs/x/prefect"]
