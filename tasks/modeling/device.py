"""Where each model of a merge runs and in what precision: one device and one dtype per model role (the trained
model, the teachers, ExOPD's reference), named in the configs as ``device`` / ``dtype`` fields.

- ``device``: ``auto`` (CUDA when torch sees a GPU, else CPU), ``cpu`` or ``cuda``. Under ``torchrun`` a CUDA model
  goes on the process's own GPU, ``cuda:$LOCAL_RANK``.
- ``dtype``: ``fp32``, ``bf16`` or ``fp16``. A frozen model (teacher, reference) is held in that dtype. A trained
  model keeps fp32 master weights and optimizer state and computes its forward and backward under autocast in that
  dtype (mixed precision: optimizer updates far smaller than a bf16 weight's resolution are not lost), and its
  rollouts come from the same weights under the same autocast. Whatever the weights' dtype, every loss, log-softmax
  and log-prob difference is computed in fp32 (:mod:`tasks.objectives.losses` upcasts the logits of both sides).

Bookkeeping tensors (token ids, masks, rewards) stay on the CPU; each model call moves its inputs to the model's
device (:func:`model_device`) and the objective moves the teacher's logits to the student's.
"""

from __future__ import annotations

import contextlib
import os
from typing import Literal

import torch

from tasks.common.problems import UserError

DeviceName = Literal["auto", "cpu", "cuda"]
DTypeName = Literal["fp32", "bf16", "fp16"]

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class NoCudaDevice(UserError, ValueError):
    """``cuda`` was asked for on a machine where torch sees no GPU."""


def resolve_device(name: DeviceName | str) -> torch.device:
    """The torch device a ``device`` setting names: ``auto`` is CUDA when torch sees a GPU, else the CPU; a CUDA
    device under ``torchrun`` (``LOCAL_RANK`` set) is that process's own GPU. ``cuda`` without a GPU is refused."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cpu":
        return torch.device("cpu")
    if name != "cuda":
        raise ValueError(f"device {name!r} is not one of auto, cpu, cuda")
    if not torch.cuda.is_available():
        raise NoCudaDevice("device 'cuda': torch sees no CUDA GPU here (torch.cuda.is_available() is False; "
                           f"torch {torch.__version__}); expected 'auto' or 'cpu' on this machine, or a CUDA build of "
                           "torch on a GPU machine")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def torch_dtype(name: DTypeName | str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s weights (its first parameter's; a sharded model's local shard's)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def compute_context(device: torch.device, dtype: torch.dtype):
    """The autocast a trained model computes under: none in fp32, else ``torch.autocast`` to ``dtype`` on the
    device's type (weights stay fp32; matrix products run in ``dtype``)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def set_compute_dtype(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Mark a trained ``model`` (fp32 weights) to compute under ``dtype``'s autocast wherever it runs: rollouts,
    scoring, the update (:func:`autocast_for`). The mark travels with the model (a copy made for overlapped
    rollouts keeps it), unlike an autocast context, which holds for one thread only."""
    model.opd_compute_dtype = dtype
    return model


def autocast_for(model: torch.nn.Module):
    """The autocast ``model`` computes under: its :func:`set_compute_dtype` mark on its device, none without one
    (fp32 models, and frozen models held in their own dtype)."""
    return compute_context(model_device(model), getattr(model, "opd_compute_dtype", torch.float32))


def place_trained(model: torch.nn.Module, device: DeviceName | str, dtype: DTypeName | str) -> torch.nn.Module:
    """A model about to be trained, on its ``device`` with fp32 weights, marked to compute under ``dtype``
    (:func:`set_compute_dtype`); returns it."""
    return set_compute_dtype(model.to(resolve_device(device)), torch_dtype(dtype))


def place_frozen(model: torch.nn.Module, device: DeviceName | str, dtype: DTypeName | str) -> torch.nn.Module:
    """``model`` frozen (no gradients, eval mode: a teacher, a reference) on its ``device``, its weights held in
    ``dtype``; returns it."""
    return model.to(device=resolve_device(device), dtype=torch_dtype(dtype)).requires_grad_(False).eval()


def resolve_backend(backend: str, device_type: str) -> str:
    """The process-group backend for a student on ``device_type``: ``auto`` is nccl on CUDA, gloo on the CPU. nccl
    on the CPU is refused: it moves only CUDA tensors."""
    if backend == "auto":
        return "nccl" if device_type == "cuda" else "gloo"
    if backend == "nccl" and device_type != "cuda":
        raise ValueError(f"dist_backend 'nccl' needs the student on CUDA GPUs (one per rank), not on {device_type}: "
                         "nccl moves only CUDA tensors; use 'gloo' or 'auto'")
    return backend


def usable_cpus() -> set[int]:
    """The CPU ids this process may use: its CPU affinity, which a container or ``taskset`` narrows (every CPU where
    the platform has no affinity)."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def cpu_threads(requested: int, procs_per_machine: int = 1) -> int:
    """torch intra-op threads for one of ``procs_per_machine`` processes: ``requested`` when set, else the cores
    this process may use (:func:`usable_cpus`) shared out evenly, at least 1."""
    if requested > 0:
        return requested
    return max(1, len(usable_cpus()) // max(1, procs_per_machine))


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op thread count set to ``n`` for the block and restored after it (the count is per process)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)
