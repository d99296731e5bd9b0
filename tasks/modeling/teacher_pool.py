"""Teachers loaded on first use, with at most ``max_resident`` in memory at once (least recently used evicted), so a
merge over a dozen teachers fits where a dozen resident models would not. Scoring stays batched per teacher: a step
touches each of its teachers once."""

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

    def __init__(self, names: list[str], load: Callable[[str], PreTrainedModel], max_resident: int = 0):
        if max_resident < 0:
            raise ValueError(f"max_resident must be >= 0 (0 = no limit), got {max_resident}")
        self.names, self.load, self.max_resident = list(names), load, max_resident
        self.resident: OrderedDict[str, PreTrainedModel] = OrderedDict()
        self.loads = 0
        self.evictions = 0
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
            gone = weakref.ref(self.resident.popitem(last=False)[1])
            self.evictions += 1
            if gone() is not None:  # kept by a reference cycle: collect now (a full gc costs ~0.3 s here, so only then)
                gc.collect()
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
