"""Merge checkpoints: everything that decides the rest of a merge, written atomically every ``opd.checkpoint_every``
steps, so that a merge killed at any point and started again with the same command resumes into the same MLflow run
and, on CPU with the transformers backends, ends with the same weights and metrics as a run never interrupted.

One folder per merge, keyed by what makes it "the same command" (:func:`merge_key`): the config without its
run-policy fields (:data:`RUN_POLICY`), the student's weights, the routed teachers and the tracking store.

    .opd/checkpoints/merge-<key>/
        run.json             the MLflow run id, written when the run is created (before any step)
        lock                 flock'ed by the process running this merge: a second one fails instead of interleaving
        latest               name of the newest committed checkpoint, replaced atomically, last
        step-00000040/       a committed checkpoint (the newest two are kept)
            student.safetensors   the student's full weights
            trainer.pt            optimizer and LR-schedule state, torch RNG state, the batch generated ahead
            state.json            step and student version, stage position, gate results, metric window, prompt
                                  sampler and python RNG states, teacher residency, cached off-policy teacher
                                  samples, evaluation scores, skipped-step count, the MLflow run id
        .tmp-*/              a checkpoint being written: never read, removed when the merge next opens its folder
        done.json            written when the merge finished (its checkpoints are then removed)

Atomicity: a checkpoint is written into a temporary folder, each file fsynced, the folder renamed to ``step-N`` and
the parent fsynced; only then is ``latest`` replaced (temp file, fsync, ``os.replace``). A kill at any point leaves
``latest`` naming a complete checkpoint, or no checkpoint at all.

The three files are one object, :class:`tasks.merging.merge_state.MergeState`, saved and read back whole.

Resume (:class:`tasks.merging.merge.MergeLoop`): checkpoints are taken only where nothing is half done (after a step's
metrics reached MLflow, at a rollout-batch boundary, the batch generated ahead by ``overlap_generation`` waited for
and stored). A rerun reopens the MLflow run, skips the finished stages and gates, restores the rest and does not log
again a value MLflow already holds for a (metric, step) from the killed attempt; timings (``time/*``) differ, so
they are logged again. A finished merge run again gets a new run. With ``opd.nproc > 1`` (FSDP) the lead gathers the
full weights and optimizer state and every rank loads them. Exact on CPU with the transformers backends; with a vLLM
engine the engine's sampling RNG is not checkpointed, so a resumed merge continues correctly but samples differently.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tasks.config import MergeConfig, flatten
from tasks.training.distill import Batch
from tasks.objectives.losses import TokenInputs
from tasks.modeling.rollout import Rollout
from tasks.specs.render import RowText
from tasks.common.paths import state_dir, write_atomic

FORMAT = 1
KEEP = 2  # committed checkpoints kept: the newest and the one before
# Fields that change how a merge is run, not what it computes: changing them keeps a merge "the same command", so
# a stopped merge can be resumed with, say, a larger opd.max_bad_steps.
RUN_POLICY = frozenset({"retries", "retry_delay_seconds", "opd.resume", "opd.checkpoint_every", "opd.max_bad_steps"})


def checkpoints_dir() -> Path:
    return state_dir() / "checkpoints"


def merge_key(cfg: MergeConfig, student_fingerprint: str, teachers_fingerprint: str, tracking: str,
              data: str = "") -> str:
    """What identifies one merge across reruns: its config (run-policy fields aside), the student's weights, the
    teachers (registry fingerprint of the routed records), the MLflow store its run lives in and its prompt set
    (``data``: the folder name, keyed on the spec's text and data files)."""
    flat = {k: v for k, v in flatten(cfg).items() if k not in RUN_POLICY}
    payload = json.dumps({"config": flat, "student": student_fingerprint, "teachers": teachers_fingerprint,
                          "tracking": tracking, **({"data": data} if data else {})}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


@dataclass
class Checkpoint:
    """A committed checkpoint, loaded: ``weights`` (the student's state dict), ``trainer`` (optimizer, schedule, torch
    RNG, pending batch) and ``state`` (everything else, JSON)."""

    path: Path
    weights: dict[str, torch.Tensor]
    trainer: dict[str, Any]
    state: dict[str, Any]

    @property
    def step(self) -> int:
        return self.state["step"]


class MergeCheckpoints:
    """The checkpoint folder of one merge (see the module docstring for its layout)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._lock_file = None

    @classmethod
    def for_merge(cls, cfg: MergeConfig, student_fingerprint: str, teachers_fingerprint: str,
                  tracking: str, data: str = "") -> MergeCheckpoints:
        key = merge_key(cfg, student_fingerprint, teachers_fingerprint, tracking, data)
        return cls(checkpoints_dir() / f"merge-{key}")

    # ------------------------------------------------------------------------------------------ the run record

    def acquire(self) -> None:
        """Hold this merge's lock until :meth:`release` or the process ends (a kill releases it too)."""
        self.root.mkdir(parents=True, exist_ok=True)
        f = open(self.root / "lock", "a+")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise RuntimeError(f"another process is running this merge (it holds {self.root / 'lock'}); wait for it "
                               "or stop it, then run the command again to resume") from None
        self._lock_file = f

    def release(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def run_id(self) -> str | None:
        """The MLflow run of the merge these checkpoints belong to (None before the first run was created)."""
        path = self.root / "run.json"
        return json.loads(path.read_text())["run_id"] if path.exists() else None

    def finished(self) -> dict | None:
        """The finished merge's record (its run id and result), or None while it is unfinished."""
        path = self.root / "done.json"
        return json.loads(path.read_text()) if path.exists() else None

    def begin(self, run_id: str) -> None:
        """Start over for a new MLflow run: drop every checkpoint and record the run id."""
        for p in self.root.iterdir() if self.root.exists() else ():
            if p.name != "lock":
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        write_atomic(self.root / "run.json", json.dumps({"run_id": run_id}) + "\n")

    def finish(self, record: dict) -> None:
        """Mark the merge finished (``record``: its run id and result) and remove its checkpoints."""
        write_atomic(self.root / "done.json", json.dumps(record, indent=2) + "\n")
        for p in self._committed():
            shutil.rmtree(p)
        (self.root / "latest").unlink(missing_ok=True)

    # ------------------------------------------------------------------------------------------ checkpoints

    def latest(self) -> Path | None:
        """The newest committed checkpoint (the one ``latest`` names), or None."""
        pointer = self.root / "latest"
        name = pointer.read_text().strip() if pointer.exists() else ""
        return self.root / name if name and (self.root / name).is_dir() else None

    def clean(self) -> None:
        """Remove what a kill can leave behind: temporary folders, and a checkpoint renamed into place whose
        ``latest`` update never happened (its step is checkpointed again). Only the lock holder may call it."""
        for p in self.root.glob(".tmp-*"):
            shutil.rmtree(p, ignore_errors=True)
        latest = self.latest()
        for p in self._committed():
            if latest is None or p.name > latest.name:
                shutil.rmtree(p)

    def load(self, path: Path) -> Checkpoint:
        state = json.loads((path / "state.json").read_text())
        if state.get("format") != FORMAT:
            raise ValueError(f"{path}: checkpoint format {state.get('format')}, this code reads {FORMAT}")
        trainer = torch.load(path / "trainer.pt", weights_only=True)
        return Checkpoint(path, load_file(path / "student.safetensors"), trainer, state)

    def save(self, weights: dict[str, torch.Tensor], trainer: dict[str, Any], state: dict[str, Any]) -> Path:
        """Write a checkpoint of step ``state["step"]`` atomically; returns its folder."""
        name = f"step-{state['step']:08d}"
        tmp = self.root / f".tmp-{name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(_unshared(weights), tmp / "student.safetensors")
        _fsync(tmp / "student.safetensors")
        torch.save(trainer, tmp / "trainer.pt")
        _fsync(tmp / "trainer.pt")
        (tmp / "state.json").write_text(json.dumps({"format": FORMAT, **state}) + "\n")
        _fsync(tmp / "state.json")
        _fsync(tmp)
        final = self.root / name
        if final.exists():  # an orphan from a kill between its rename and the pointer update
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync(self.root)
        write_atomic(self.root / "latest", name + "\n")
        for old in self._committed()[:-KEEP]:
            shutil.rmtree(old)
        return final

    def _committed(self) -> list[Path]:
        return sorted(p for p in self.root.glob("step-*") if p.is_dir()) if self.root.exists() else []


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unshared(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, tied ones copied: safetensors refuses tensors that share memory."""
    out, seen = {}, set()
    for k, v in weights.items():
        v = v.detach().cpu().contiguous()
        if v.data_ptr() in seen:
            v = v.clone()
        seen.add(v.data_ptr())
        out[k] = v
    return out


def batch_state(batch: Batch | None) -> dict | None:
    """A :class:`tasks.training.distill.Batch` as plain tensors, lists and numbers (``torch.load(weights_only=True)`` reads
    it)."""
    if batch is None:
        return None
    return {"rollout": vars(batch.rollout), "routes": batch.routes, "answers": batch.answers,
            "on_policy": batch.on_policy, "version": batch.version, "rewards_B": batch.rewards_B,
            "tokens": None if batch.tokens is None else vars(batch.tokens), "generated": batch.generated,
            "generated_tokens": batch.generated_tokens,
            "texts": [{"route": t.route, "prompt": t.prompt, "messages": t.chat, "context": t.context}
                      for t in batch.texts]}


def batch_from_state(state: dict | None) -> Batch | None:
    if state is None:
        return None
    tokens = None if state["tokens"] is None else TokenInputs(**state["tokens"])
    texts = [RowText.of(t["route"], t["prompt"], t["messages"], t["context"]) for t in state.get("texts", [])]
    return Batch(Rollout(**state["rollout"]), state["routes"], state["answers"], state["on_policy"], state["version"],
                 state["rewards_B"], tokens, state["generated"], state.get("generated_tokens", 0), texts)
