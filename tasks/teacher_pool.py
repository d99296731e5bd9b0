"""Teachers loaded on first use, with at most ``max_resident`` in memory at once (least recently used evicted), so a
merge over a dozen teachers fits where a dozen resident models would not. Scoring stays batched per teacher: a step
touches each of its teachers once."""

from __future__ import annotations

import gc
from collections import OrderedDict
from collections.abc import Mapping
from typing import Callable, Iterator

from transformers import PreTrainedModel


class TeacherPool(Mapping):
    """``pool[name]`` is the teacher model, loaded by ``load(name)`` when not resident. ``max_resident`` 0 keeps every
    teacher once loaded. ``loads`` and ``evictions`` count what happened (logged by the merge)."""

    def __init__(self, names: list[str], load: Callable[[str], PreTrainedModel], max_resident: int = 0):
        if max_resident < 0:
            raise ValueError(f"max_resident must be >= 0 (0 = no limit), got {max_resident}")
        self.names, self.load, self.max_resident = list(names), load, max_resident
        self.resident: OrderedDict[str, PreTrainedModel] = OrderedDict()
        self.loads = 0
        self.evictions = 0

    def __getitem__(self, name: str) -> PreTrainedModel:
        if name not in self.names:
            raise KeyError(f"no teacher {name!r} in this merge; teachers: {self.names}")
        if name in self.resident:
            self.resident.move_to_end(name)
            return self.resident[name]
        while self.max_resident and len(self.resident) >= self.max_resident:
            self.resident.popitem(last=False)
            self.evictions += 1
            gc.collect()
        model = self.load(name)
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
