"""The sharded merge's processes, started by ``torchrun`` (``torch.distributed.run``): this module is the entry point
of every rank, and :func:`launch` is the merge task's side, which starts ``torchrun`` for this machine.

Run (the merge task does it for this machine; with ``opd.nnodes`` > 1 it prints the same command, which every other
machine runs, from a checkout of the same commit, with the same ``OPD_HOME`` on a shared filesystem and the same
``MLFLOW_TRACKING_URI``):

    torchrun --nnodes NNODES --nproc-per-node NPROC --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id RUN_ID \\
        -m tasks.training.launch JOB_DIR

On one machine the merge task runs ``torchrun --standalone`` instead (a c10d rendezvous on a free loopback port).
NPROC is ``opd.nproc / opd.nnodes``; HOST:PORT is ``opd.rdzv_endpoint``, this machine as the others reach it; RUN_ID
is the merge's MLflow run id. Each rank joins the process group from torchrun's environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), on its own GPU (``cuda:$LOCAL_RANK``) when the
student is on CUDA, and runs the job's function (:func:`tasks.merging.merge.merge_rank`).

JOB_DIR (``<state>/jobs/<run id>/``, :func:`job_dir`) is where the merge task and the ranks meet:

    job.pkl          what every rank runs (written by the merge task): the function, its arguments (the merge
                     config, prompt-set path, router, MLflow run id, checkpoint folder), the backend and the device
    result.json      rank 0's return value (the merge's references), written when it finishes
    error-<R>.pkl    rank R's exception (pickled, when it can be) and its traceback text, written when it fails
    .key             the job's secret (32 random bytes, owner-only): every pickle above is signed with it
                     (HMAC-SHA256) and none is unpickled unless its signature verifies (:func:`unseal`), so a file
                     another user or process dropped into the folder is refused, never run

A rank that fails writes its error and exits; torchrun then stops the others (a collective they wait in would
otherwise never return) and :func:`launch` raises that rank's exception, with its traceback there as a note.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import pickle
import secrets
import re
import shlex
import subprocess
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tasks.common.paths import PROJECT_ROOT, state_dir, write_atomic

JOB, RESULT, KEY = "job.pkl", "result.json", ".key"


class UnsignedJobFile(ValueError):
    """A pickle in a job folder whose signature does not verify against the job's key: refused unread."""


def job_key(folder: Path) -> bytes:
    """The job's secret, made once per folder (owner-only, 0600); every machine of a job reads it from the shared
    folder."""
    path = folder / KEY
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_bytes()
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
    return path.read_bytes()


def seal(key: bytes, obj: Any) -> bytes:
    """``obj`` pickled, behind its HMAC-SHA256 under ``key``."""
    data = pickle.dumps(obj)
    return hmac.new(key, data, hashlib.sha256).digest() + data


def unseal(key: bytes, blob: bytes, what: str) -> Any:
    """The object :func:`seal` sealed, unpickled only when its signature verifies; otherwise
    :class:`UnsignedJobFile` (nothing of it is unpickled)."""
    mac, data = blob[:32], blob[32:]
    if not hmac.compare_digest(mac, hmac.new(key, data, hashlib.sha256).digest()):
        raise UnsignedJobFile(f"{what}: its signature does not match this job's key, so it was not written by this "
                              "job's processes; refused without unpickling it")
    return pickle.loads(data)


def job_dir(run_id: str) -> Path:
    """The job folder of the sharded merge of MLflow run ``run_id``, under the state folder."""
    return state_dir() / "jobs" / run_id


def torchrun_args(folder: Path, nproc_per_node: int, nnodes: int = 1, endpoint: str = "",
                  rdzv_id: str = "") -> list[str]:
    """``torchrun``'s arguments for the job in ``folder``: ``--standalone`` on one machine without an endpoint, else
    the c10d rendezvous at ``endpoint`` that every machine joins with the same ``rdzv_id``."""
    job = ["-m", "tasks.training.launch", str(folder)]
    if nnodes == 1 and not endpoint:
        return ["--standalone", "--nnodes", "1", "--nproc-per-node", str(nproc_per_node), *job]
    if not endpoint or not rdzv_id:
        raise ValueError(f"{nnodes} machines need a rendezvous endpoint (HOST:PORT) and id, got {endpoint!r} and "
                         f"{rdzv_id!r}")
    return ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id, *job]


def node_command(folder: Path, nproc_per_node: int, nnodes: int, endpoint: str, rdzv_id: str) -> str:
    """The shell command each machine of a multi-machine job runs (the same on every one of them)."""
    return shlex.join(["torchrun", *torchrun_args(folder, nproc_per_node, nnodes, endpoint, rdzv_id)])


def write_job(folder: Path, fn: Callable[..., Any], args: tuple, backend: str, device: str) -> Path:
    """A fresh job in ``folder``: ``job.pkl`` written, the result and errors of an earlier attempt removed."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in [folder / RESULT, *folder.glob("error-*.pkl")]:
        old.unlink(missing_ok=True)
    tmp = folder / f".{JOB}.{os.getpid()}.tmp"
    tmp.write_bytes(seal(job_key(folder), {"fn": fn, "args": args, "backend": backend, "device": device}))
    os.replace(tmp, folder / JOB)
    return folder


def launch(fn: Callable[..., Any], args: tuple, folder: Path, *, nproc_per_node: int, nnodes: int = 1,
           endpoint: str = "", rdzv_id: str = "", backend: str = "gloo", device: str = "cpu") -> Any:
    """``fn(*args)`` on ``nproc_per_node`` ranks of this machine (``nnodes`` machines in all), started by
    ``torchrun`` as a subprocess with this process's environment; returns rank 0's result (``fn``'s JSON-able
    return value). Their output is forwarded line by line (:func:`tasks.common.log.say`). A rank that fails fails
    the call with its own exception (see :func:`raise_failed_rank`), never leaves it waiting."""
    from tasks.common.log import say

    write_job(folder, fn, args, backend, device)
    cmd = [sys.executable, "-m", "torch.distributed.run",
           *torchrun_args(folder, nproc_per_node, nnodes, endpoint, rdzv_id)]
    if nnodes > 1:
        say(f"waiting for the other {nnodes - 1} machine(s) of this job (torchrun's rendezvous at {endpoint}); run "
            f"on each, from a checkout of the same commit, with OPD_HOME={state_dir()} shared by all and the same "
            f"MLFLOW_TRACKING_URI:\n  {node_command(folder, nproc_per_node, nnodes, endpoint, rdzv_id)}")
    # The ranks import the project from this checkout; tests/faults' sitecustomize (when PYTHONPATH names it) stays
    # first on the path, so the ranks get the fault points too.
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join([*path, str(PROJECT_ROOT)])}
    tail: deque[str] = deque(maxlen=40)
    proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        _forward(proc.stdout, tail, say)
        code = proc.wait()
    finally:
        if proc.poll() is None:  # interrupted here (a cancelled task): stop torchrun, which stops its ranks
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        proc.stdout.close()
    if code != 0:
        raise_failed_rank(folder, f"torchrun exited with status {code}; its last output:\n" + "\n".join(tail))
    result = folder / RESULT
    if not result.exists():
        raise RuntimeError(f"torchrun finished but rank 0 wrote no {result}: with several machines, {folder} must "
                           "be on a filesystem every machine shares (OPD_HOME)")
    return json.loads(result.read_text())


def _forward(stream, tail: deque, say: Callable[[str], None]) -> None:
    """Forward the ranks' output as it comes: each line to ``say`` (and ``tail``); a progress bar redrawing itself
    (text ended by ``\\r``) to this process's stderr only."""
    pending = b""
    while chunk := stream.read1(1 << 16):
        pending += chunk
        *parts, pending = re.split(rb"(\r|\n)", pending)
        for text, sep in zip(parts[::2], parts[1::2]):
            line = text.decode(errors="replace")
            if sep == b"\r":
                if line:
                    sys.stderr.write("\r" + line)
                    sys.stderr.flush()
            elif line.strip():
                tail.append(line)
                say(line)
    if pending.strip():
        tail.append(pending.decode(errors="replace"))
        say(tail[-1])


def raise_failed_rank(folder: Path, report: str) -> None:
    """Raise the error of the rank that failed first for a reason of its own: errors of a broken collective (which
    another rank's death causes) come after the others. The rank's exception is raised as it is (the same type and
    message, so retry policies and callers see what they would in one process), with the rank and its traceback
    there as a note; an exception that cannot be unpickled here becomes a RuntimeError with that text. With no
    error of its own from any rank (a rank killed by a signal, or out of memory), a RuntimeError says so, with
    ``report`` (torchrun's own)."""
    key = job_key(folder)
    errors = sorted((unseal(key, p.read_bytes(), str(p)) for p in folder.glob("error-*.pkl")),
                    key=lambda e: (e["collective"], e["time"]))
    if not errors or errors[0]["collective"]:
        broken = (f" (rank {errors[0]['rank']} saw its collective break: "
                  f"{errors[0]['traceback'].strip().splitlines()[-1]})" if errors else "")
        raise RuntimeError(f"the sharded job {folder.name} failed with no Python error from any rank of its own"
                           f"{broken}: a rank killed (by a signal, or for lack of memory), or torchrun's own "
                           f"failure (a rendezvous that timed out waiting for the other machines?). {report}")
    first = errors[0]
    where = f"rank {first['rank']} of the sharded job {folder.name} ({first['host']}, pid {first['pid']})"
    try:
        exc = unseal(key, first["exception"], "its exception") if first["exception"] is not None else None
    except Exception:  # a class this process cannot import: the text below says everything
        exc = None
    if not isinstance(exc, BaseException):
        raise RuntimeError(f"{where} failed:\n{first['traceback']}")
    exc.add_note(f"raised on {where}; its traceback there:\n{first['traceback']}")
    raise exc


def _is_collective_error(e: BaseException) -> bool:
    import torch.distributed as dist

    # nccl raises DistBackendError; gloo a RuntimeError from its transport ("Connection closed by peer", "Read error
    # ... Connection reset by peer").
    return isinstance(e, dist.DistError) or bool(re.search(r"gloo/transport|connection (closed|reset)|broken pipe",
                                                           str(e).lower()))


def _write_error(folder: Path, rank: int, e: BaseException) -> None:
    key = job_key(folder)
    try:
        exception = seal(key, e)  # (one that pickles but cannot be rebuilt is left to the text: raise_failed_rank)
    except Exception:
        exception = None
    record = {"rank": rank, "time": time.time(), "host": os.uname().nodename, "pid": os.getpid(),
              "collective": _is_collective_error(e), "exception": exception,
              "traceback": "".join(traceback.format_exception(e))}
    tmp = folder / f".error-{rank}.{os.getpid()}.tmp"
    tmp.write_bytes(seal(key, record))
    os.replace(tmp, folder / f"error-{rank}.pkl")


def main(argv: list[str] | None = None) -> None:
    """One rank: join the process group from torchrun's environment, run the job in the folder ``argv`` names, write
    rank 0's result or this rank's error there. The process then leaves at once (``os._exit``): seen on this
    machine, the store's client thread can abort interpreter teardown (SIGABRT) after the work is done, which
    torchrun would take for a failure."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.exit(f"usage: torchrun [...] -m {__name__} JOB_DIR")
    folder = Path(argv[0]).resolve()
    rank = int(os.environ["RANK"])
    code = 0
    try:
        import torch
        import torch.distributed as dist

        job = unseal(job_key(folder), (folder / JOB).read_bytes(), str(folder / JOB))
        if job["device"] == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(job["backend"])  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun
        result = job["fn"](*job["args"])
        if rank == 0:
            write_atomic(folder / RESULT, json.dumps(result))
        dist.destroy_process_group()
    except BaseException as e:
        _write_error(folder, rank, e)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
