"""Teachers loaded on first use, with at most ``max_resident`` on their device at once (least recently used evicted), so
a merge over a dozen teachers fits where a dozen resident models would not. Scoring stays batched per teacher: a step
touches each of its teachers once.

An evicted teacher is dropped (loaded again from its checkpoint when next needed), or, on a GPU, parked in host
memory (:func:`park_on_host`: pinned CPU memory) and moved back to the GPU to score: a host-to-device copy instead of
a read from disk, so a GPU that holds two teachers serves twelve."""

from __future__ import annotations

import gc
import itertools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from typing import Callable, Iterator

import torch
from transformers import PreTrainedModel


def own_memory(model: torch.nn.Module) -> torch.nn.Module:
    """Copy every weight out of the checkpoint's memory map into memory the model owns. transformers loads
    safetensors zero-copy, each weight a view of the mapped file; any tensor kept from an evicted teacher (the output
    head that scoring keeps until the student's update) would pin the whole mapping, with every page its forward
    touched, so evicting would free nothing. Tied weights stay tied (one parameter, copied once)."""
    with torch.no_grad():
        for t in itertools.chain(model.parameters(), model.buffers()):
            t.data = t.data.clone()
    return model


class TeacherPool(Mapping):
    """``pool[name]`` is the teacher model, loaded by ``load(name)`` when not resident. ``max_resident`` 0 keeps every
    teacher once loaded; otherwise each loaded teacher is moved into memory of its own (:func:`own_memory`), so that
    evicting it releases its memory. ``loads`` and ``evictions`` count what happened (logged by the merge)."""

    def __init__(self, names: list[str], load: Callable[[str], PreTrainedModel], max_resident: int = 0,
                 park: Callable[[PreTrainedModel], PreTrainedModel] | None = None,
                 unpark: Callable[[PreTrainedModel], PreTrainedModel] | None = None):
        if max_resident < 0:
            raise ValueError(f"max_resident must be >= 0 (0 = no limit), got {max_resident}")
        if (park is None) != (unpark is None):
            raise ValueError("park and unpark come together (an evicted teacher parked must be brought back)")
        self.names, self.load, self.max_resident = list(names), load, max_resident
        self.park, self.unpark = park, unpark
        self.resident: OrderedDict[str, PreTrainedModel] = OrderedDict()
        self.parked: dict[str, PreTrainedModel] = {}  # evicted teachers waiting off the device (with park)
        self.loads = 0
        self.evictions = 0
        self.unparks = 0
        # The overlapped rollout thread (teacher samples) and the main thread (scoring) may both ask for teachers.
        self._lock = threading.RLock()

    def __getitem__(self, name: str) -> PreTrainedModel:
        if name not in self.names:
            raise KeyError(f"no teacher {name!r} in this merge; teachers: {self.names}")
        with self._lock:
            return self._get(name)

    def _get(self, name: str) -> PreTrainedModel:
        if name in self.resident:
            self.resident.move_to_end(name)
            return self.resident[name]
        while self.max_resident and len(self.resident) >= self.max_resident:
            evicted, model = self.resident.popitem(last=False)
            self.evictions += 1
            if self.park is not None:
                self.parked[evicted] = self.park(model)
                continue
            gone = weakref.ref(model)
            del model
            if gone() is not None:  # kept by a reference cycle: collect now (a full gc costs ~0.3 s here, so only then)
                gc.collect()
        if name in self.parked:
            model = self.unpark(self.parked.pop(name))
            self.unparks += 1
        else:
            model = self.load(name)
            if self.max_resident:
                own_memory(model)
            self.loads += 1
        self.resident[name] = model
        return model

    def resident_first(self, groups: Mapping[str, list[int]]) -> dict[str, list[int]]:
        """``groups`` (teacher -> rows) reordered so that resident teachers score first, least recently used first.
        A step that needs more teachers than fit then loads each missing teacher once and evicts only teachers it
        has already used: 12 teachers with 4 resident cost 8 loads a step instead of ~11 in arbitrary order."""
        order = [n for n in self.resident if n in groups] + [n for n in groups if n not in self.resident]
        return {n: groups[n] for n in order}

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self.names


def park_on_host(model: torch.nn.Module) -> torch.nn.Module:
    """``model``'s weights moved to host memory, pinned where CUDA is present (so moving them back to the GPU is a
    fast, asynchronous copy); in place, returns it."""
    model.to("cpu")
    if torch.cuda.is_available():
        with torch.no_grad():
            for t in itertools.chain(model.parameters(), model.buffers()):
                t.data = t.data.pin_memory()
    return model


def host_parking(device: torch.device, offload: str) -> dict:
    """The :class:`TeacherPool` arguments that park evicted teachers in host memory and bring them back to ``device``
    (``teacher_offload`` ``cpu`` with teachers on a GPU); none (evicted teachers are dropped) on the CPU or with
    ``disk``."""
    if device.type == "cpu" or offload != "cpu":
        return {}
    return {"park": park_on_host, "unpark": lambda model: model.to(device, non_blocking=True)}
