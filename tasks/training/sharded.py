"""The student update on several processes: FSDP2 (``torch.distributed.fsdp.fully_shard``) over a process group.

With ``opd.nproc = N > 1`` the merge task starts ``torchrun`` (:mod:`tasks.training.launch`), which runs N ranks, on
one machine or spread over ``opd.nnodes``; every rank runs the same merge loop on a student sharded by
:func:`shard_student`. FSDP's forward is collective, so every rank makes the same model calls: it generates the whole
batch (same seed, same samples), then scores and learns on its contiguous rows only (:func:`rows_of`,
:func:`shard_groups`, ``update_step(shard=...)``). Each rank's loss is its rows' share of the whole batch's loss (the
normaliser is the whole batch's response tokens) and FSDP sums the gradients, so N ranks take the step one process
takes on the whole batch. Only rank 0 logs, saves and registers.

The process group's backend (:func:`tasks.modeling.device.resolve_backend`) follows the student's device: nccl between GPUs (each rank on
its own, ``cuda:$LOCAL_RANK``), gloo between CPU processes.

Run (a quick merge with the student update on 2 processes):
    python -m flows.merge --profile quick --opd.nproc 2
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from transformers import PreTrainedModel

from tasks.modeling.device import model_device
from tasks.training.distill import StepStats
from tasks.objectives.losses import DIAGNOSTICS


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def comm_device() -> torch.device:
    """Where the process group's tensors must be: this rank's GPU under nccl, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shard_student(model: PreTrainedModel, device: torch.device | str | None = None) -> PreTrainedModel:
    """Shard ``model`` over the process group, in place: one FSDP unit per decoder layer (``_no_split_modules``),
    then the root (embeddings, final norm, output head). The loss runs the decoder and then the head chunk by chunk,
    outside the root's forward, so a pre-hook on the decoder all-gathers the root's parameters first (its backward
    then reduce-scatters them). Gradients are summed over ranks, not averaged: each rank's loss is already its share
    of the whole batch's (see ``update_step``'s ``shard``).

    The shards live on ``device``: by default the student's, or under nccl this rank's GPU, the one
    :func:`tasks.training.launch.main` made current (``cuda:$LOCAL_RANK``; FSDP moves the weights there)."""
    if device is None:
        device = comm_device() if dist.get_backend() == "nccl" else model_device(model)
    device = torch.device(device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)  # FSDP places the shards on the current device of the mesh's type
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    layer_types = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.get_decoder().modules() if type(m).__name__ in layer_types]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found to shard (_no_split_modules {layer_types})")
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    # The root reshards after its forward too (FSDP's default keeps it gathered, which would leave stale gathered
    # copies registered as the parameters after generation: the optimizer and the state dict must see the shards).
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    gloo = dist.get_backend() == "gloo"
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            if gloo:
                m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM (nccl has it)
    model.get_decoder().register_forward_pre_hook(lambda *_: model.unshard())
    with torch.no_grad():  # the first forward must enter at the root: FSDP takes the module it enters as its root
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
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
    total = torch.tensor(vals, dtype=torch.float64, device=comm_device())
    dist.all_reduce(total)
    seconds = torch.tensor(list(st.seconds.values()), dtype=torch.float64, device=comm_device())
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
