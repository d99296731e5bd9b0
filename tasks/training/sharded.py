"""The student update on several processes: FSDP2 (``torch.distributed.fsdp.fully_shard``) over a process group.

With ``opd.nproc = N > 1`` the merge task is rank 0 and spawns ranks 1..N-1 (:func:`run_ranks`); every rank runs the
same merge loop on a student sharded by :func:`shard_student`. FSDP's forward is collective, so every rank makes the
same model calls: it generates the whole batch (same seed, same samples), then scores and learns on its contiguous
rows only (:func:`rows_of`, :func:`shard_groups`, ``update_step(shard=...)``). Each rank's loss is its rows' share of
the whole batch's loss (the normaliser is the whole batch's response tokens) and FSDP sums the gradients, so N
ranks take the step one process takes on the whole batch. Only rank 0 logs, saves and registers.

Run (a quick merge with the student update on 2 processes):
    python -m flows.merge --profile quick --opd.nproc 2
"""

from __future__ import annotations

import os
import sys

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from transformers import PreTrainedModel

from tasks.training.distill import StepStats
from tasks.objectives.losses import DIAGNOSTICS

T = TypeVar("T")


def resolve_backend(backend: str) -> str:
    """``auto`` is gloo: this pipeline runs its models on CPU (nccl needs them on GPUs, one per rank)."""
    return "gloo" if backend == "auto" else backend


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def run_ranks(fn: Callable[..., T], nproc: int, backend: str, *args: Any) -> T:
    """``fn(*args)`` on ``nproc`` ranks of one process group: this process is rank 0 and returns its result, ranks
    1..nproc-1 are spawned processes (one torch thread each). A rank that fails fails the call with its traceback
    (a peer's death breaks the collective the others wait in) instead of leaving the others waiting."""
    if dist.is_initialized():
        raise RuntimeError("a process group is already active in this process: one sharded run at a time")
    backend = resolve_backend(backend)
    store = dist.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)  # port 0: no port race
    ranks = mp.start_processes(_spawned_rank, args=(fn, args, nproc, backend, store.port), nprocs=nproc - 1,
                               join=False, start_method="spawn")
    try:
        started = [f"started/{r}" for r in range(1, nproc)]
        while not store.check(started):  # a rank that cannot start (say, an import error) fails here, not in a wait
            ranks.join(timeout=0.5)
        dist.init_process_group(backend, store=store, rank=0, world_size=nproc)
        try:
            result = fn(*args)
        finally:
            dist.destroy_process_group()
    except BaseException as e:
        # A collective that failed here usually means another rank died first: its error is the one to show.
        _raise_failed_rank(ranks, grace_s=30.0, cause=e)
        raise
    while not ranks.join():
        pass
    return result


def _spawned_rank(i: int, fn: Callable, args: tuple, nproc: int, backend: str, port: int) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, nproc, is_master=False)
    store.set(f"started/{i + 1}", "1")
    dist.init_process_group(backend, store=store, rank=i + 1, world_size=nproc)
    try:
        fn(*args)
    finally:
        dist.destroy_process_group()
    # Seen on this machine: the store's client thread can abort interpreter teardown ("terminate called without an
    # active exception", SIGABRT) after the work is done. The rank has finished, so it leaves without running C++
    # static destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _raise_failed_rank(ranks: mp.ProcessContext, grace_s: float, cause: BaseException) -> None:
    """Wait up to ``grace_s`` for the spawned ranks (rank 0 has left the group, which unblocks them); raise the first
    one's error if one failed for a reason of its own, else stop them and return."""
    try:
        ranks.join(timeout=grace_s, grace_period=5.0)
    except mp.ProcessRaisedException as failed:
        if _is_collective_error(cause):
            traceback = failed.msg.split("with the following error:\n", 1)[-1]
            raise RuntimeError(f"rank {failed.error_index + 1} of the sharded merge failed:\n{traceback}") from cause
    except mp.ProcessExitedException as failed:
        if _is_collective_error(cause):
            raise RuntimeError(f"rank {failed.error_index + 1} of the sharded merge died: {failed}") from cause
    for p in ranks.processes:
        if p.is_alive():
            p.kill()
        p.join()


def _is_collective_error(e: BaseException) -> bool:
    return isinstance(e, dist.DistError) or "gloo" in str(e).lower() or "connection closed" in str(e).lower()


def shard_student(model: PreTrainedModel) -> PreTrainedModel:
    """Shard ``model`` over the process group, in place: one FSDP unit per decoder layer (``_no_split_modules``),
    then the root (embeddings, final norm, output head). The loss runs the decoder and then the head chunk by chunk,
    outside the root's forward, so a pre-hook on the decoder all-gathers the root's parameters first (its backward
    then reduce-scatters them). Gradients are summed over ranks, not averaged: each rank's loss is already its share
    of the whole batch's (see ``update_step``'s ``shard``)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    layer_types = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.get_decoder().modules() if type(m).__name__ in layer_types]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found to shard (_no_split_modules {layer_types})")
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    # The root reshards after its forward too (FSDP's default keeps it gathered, which would leave stale gathered
    # copies registered as the parameters after generation: the optimizer and the state dict must see the shards).
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    model.get_decoder().register_forward_pre_hook(lambda *_: model.unshard())
    with torch.no_grad():  # the first forward must enter at the root: FSDP takes the module it enters as its root
        model(input_ids=torch.zeros(1, 1, dtype=torch.long), use_cache=False)
    return model


def rows_of(n: int, r: int | None = None, world: int | None = None) -> slice:
    """Rank ``r``'s contiguous rows of an ``n``-row batch (sizes differ by at most one; the first ranks get more)."""
    r = rank() if r is None else r
    world = dist.get_world_size() if world is None else world
    base, extra = divmod(n, world)
    start = r * base + min(r, extra)
    return slice(start, start + base + (r < extra))


def shard_groups(groups: dict[str, list[int]], rows: slice) -> dict[str, list[int]]:
    """Teacher -> row indices (as :meth:`teachers.router.Router.group` makes them) kept to ``rows``; teachers left
    without a row are dropped."""
    kept = {name: [i for i in idx if rows.start <= i < rows.stop] for name, idx in groups.items()}
    return {name: idx for name, idx in kept.items() if idx}


_SUMMED = ("loss_sum", "kl_sum", "kl_tokens", "sequences", "truncated", "reward_sum", *DIAGNOSTICS, "repetition",
           "length")


def sum_stats(st: StepStats, routes: list[str]) -> StepStats:
    """The whole batch's :class:`StepStats` from each rank's (each saw its rows): per-route sums and the loss summed
    over ranks; times are the slowest rank's. Collective: every rank calls it."""
    vals = [st.loss] + [float(getattr(st, f).get(r, 0.0)) for f in _SUMMED for r in routes]
    total = torch.tensor(vals, dtype=torch.float64)
    dist.all_reduce(total)
    seconds = torch.tensor(list(st.seconds.values()), dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    it = iter(total.tolist()[1:])
    sums = {f: {r: next(it) for r in routes} for f in _SUMMED}
    present = [r for r in routes if sums["sequences"][r] > 0]
    out = StepStats(loss=total[0].item(), tokens=st.tokens, seconds=dict(zip(st.seconds, seconds.tolist())),
                    grad_norm=st.grad_norm, skipped=st.skipped)  # the norm is global: the same on every rank
    for f in _SUMMED:
        cast = int if f in ("sequences", "truncated") else float
        setattr(out, f, {r: cast(sums[f][r]) for r in present})
    return out


def full_state_dict(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The sharded ``model``'s full state dict, gathered to CPU on rank 0 (empty elsewhere), to save as a normal
    checkpoint. Collective: every rank calls it."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
