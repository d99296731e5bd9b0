"""Teachers that are LoRA adapters of one base, held as one copy of that base with every adapter attached (peft's
multi-adapter model) instead of one merged model each; a teacher scores with its own adapter switched on.

A LoRA specialist is saved merged into its base with its adapter beside it (``<checkpoint>/adapter``,
:func:`tasks.training.sft.save_trained`); a registered adapter folder is one too. Twelve such specialists of a 135M
base cost one base (0.54 GB in fp32) plus twelve adapters (a few MB each) instead of twelve merged models (6.5 GB).
The forward runs the unmerged adapter (the base's linears plus their rank-r products), so each teacher still scores
its own rows in one pass, exactly the merged model's numbers up to float rounding.

One model serves every teacher of its base, so a teacher's model is good until another teacher of that base is asked
for: callers that ask from two threads at once (``opd.overlap_generation``) are refused by the merge's config."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Iterator

import torch
from transformers import PreTrainedModel

from tasks.common.adapters import base_of, saved_adapter
from tasks.modeling.routing import TeacherRecord, reads_own_text


def adapter_of(rec: TeacherRecord) -> tuple[str, str] | None:
    """``(adapter folder, its base)`` of a registered teacher: its ``model_uri`` when that is an adapter folder, else
    the adapter saved beside a merged LoRA checkpoint (``<model_uri>/adapter``); None for a checkpoint with no adapter
    (a full fine-tune, a hub id) or an adapter that names no base. The base is the record's ``base_model`` where it
    names one, else the adapter's own config's."""
    named = getattr(rec, "base_model", "") or None
    for folder in (rec.model_uri, saved_adapter(rec.model_uri)):
        try:
            base = base_of(folder, named) if folder is not None else None
        except ValueError:  # an adapter config naming no base, and a record naming none either
            return None
        if base is not None:
            return str(folder), base
    return None


def sharing_groups(records: Mapping[str, TeacherRecord]) -> dict[str, dict[str, str]]:
    """``{base: {teacher name: adapter folder}}`` for the teachers of ``records`` that score the student's exact tokens
    (plain or guided) and are adapters of one base shared with at least one other teacher (a base with one adapter
    gains nothing: it stays a merged model)."""
    groups: dict[str, dict[str, str]] = {}
    for name, rec in records.items():
        if reads_own_text(rec) or (found := adapter_of(rec)) is None:
            continue
        folder, base = found
        groups.setdefault(base, {})[name] = folder
    return {base: adapters for base, adapters in groups.items() if len(adapters) > 1}


class SharedBase(Mapping):
    """``shared[name]``: the one model of ``base`` with teacher ``name``'s adapter active (frozen). Loaded on first
    use by ``load_base()`` (the base, frozen on its device in its dtype); every adapter of ``adapters`` (name ->
    folder) is attached then. Refused where an adapter trains the output head or the embeddings (the head a score
    keeps would change with the next teacher's adapter)."""

    def __init__(self, base: str, adapters: Mapping[str, str], load_base: Callable[[], PreTrainedModel]):
        if not adapters:
            raise ValueError(f"no adapters to share base {base}")
        self.base, self.adapters, self.load_base = base, dict(adapters), load_base
        self.model: PreTrainedModel | None = None
        self.loads = 0
        self._lock = threading.Lock()

    def _load(self) -> PreTrainedModel:
        from peft import PeftModel
        from peft.tuners.tuners_utils import BaseTunerLayer

        base_model = self.load_base()
        (first, folder), *rest = self.adapters.items()
        # peft initialises each adapter at random before reading its weights: off the global generator's stream, so
        # that loading teachers this way leaves the merge's sampling as it is with merged teachers.
        with torch.random.fork_rng(devices=[]):
            model = PeftModel.from_pretrained(base_model, folder, adapter_name=first, is_trainable=False)
            for name, folder in rest:
                model.load_adapter(folder, adapter_name=name, is_trainable=False)
        for part in (model.get_output_embeddings(), model.get_input_embeddings()):
            if isinstance(part, BaseTunerLayer):
                raise ValueError(f"teachers {sorted(self.adapters)} cannot share base {self.base}: an adapter trains "
                                 "the model's embeddings or output head, which every teacher's scores read; expected "
                                 "adapters on the attention / MLP projections (or opd.teacher_sharing off)")
        # Frozen where the base was placed: the adapters were read onto the CPU in fp32.
        param = next(base_model.parameters())
        model.to(device=param.device, dtype=param.dtype).requires_grad_(False).eval()
        self.loads += 1
        return model

    def __getitem__(self, name: str) -> PreTrainedModel:
        if name not in self.adapters:
            raise KeyError(f"teacher {name!r} has no adapter on base {self.base}; its teachers: {sorted(self.adapters)}")
        with self._lock:
            if self.model is None:
                self.model = self._load()
            if self.model.active_adapter != name:
                self.model.set_adapter(name, inference_mode=True)
            return self.model

    def release(self) -> None:
        self.model = None

    def __iter__(self) -> Iterator[str]:
        return iter(self.adapters)

    def __len__(self) -> int:
        return len(self.adapters)


class TeacherModels(Mapping):
    """Name -> teacher model: the shared bases' teachers (:class:`SharedBase`) first, every other name from
    ``rest`` (a :class:`tasks.modeling.teacher_pool.TeacherPool`)."""

    def __init__(self, rest: Mapping[str, PreTrainedModel], shared: list[SharedBase]):
        self.rest, self.shared = rest, list(shared)
        self.names = list(rest)

    def __getitem__(self, name: str) -> PreTrainedModel:
        for s in self.shared:
            if name in s:
                return s[name]
        return self.rest[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self.rest or any(name in s for s in self.shared)

