"""Where the fault points sit: :func:`install` wraps production functions so that :func:`tests.faults.rules.fault`
runs at each point, without a line of fault code in the production modules.

Each point wraps a call its production function makes, and only that call: the wrapper looks at its caller's code
object (``sys._getframe(1).f_code``) and fires only when called from the function the point belongs to.

    generate            ``verifier_rewards`` as tasks.training.distill sees it, called by ``sample_batch``: the batch is
                        sampled (and log-probed), not yet rewarded, scored or learned from
    loss                ``chunked_objective`` as tasks.training.distill sees it, called by ``update_step``: one hit per
                        update_step call (at its first objective); ``nan`` multiplies every objective loss of that
                        step by NaN, so the summed loss and the backward pass are NaN for real
    update              ``torch.nn.utils.clip_grad_norm_``, called by ``update_step``: gradients computed and
                        clipped, optimizer not stepped
    checkpoint_write    ``_fsync`` as tasks.training.checkpoint sees it, called by ``MergeCheckpoints.save`` on the student's
                        weights: one file of the temporary checkpoint folder written, the others and the commit not
    checkpoint_saved    ``MergeCheckpoints.save`` returned: the checkpoint is committed
    specialist/<route>  ``log_eval`` as tasks.training.specialist sees it, called by ``train_specialist`` (its final
                        evaluation): the specialist trained, not evaluated or saved

Every wrapped name is looked up at call time (a module global of the calling module, a class attribute, an
attribute of ``torch.nn.utils``), so a module is patched right after its own code ran, before any importer gets its
names: an import hook on ``sys.meta_path`` does that for modules imported later, and modules already imported are
patched at once. :func:`missing_anchors` says which point lost the call it hooks (a refactor moved it).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.abc
import inspect
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import CodeType, ModuleType

from tests.faults.rules import fault

# point -> (module, function, the name that function must call for the point to be hooked)
ANCHORS = {
    "generate": ("tasks.training.distill", "sample_batch", "verifier_rewards"),
    "loss": ("tasks.training.distill", "update_step", "chunked_objective"),
    "update": ("tasks.training.distill", "update_step", "clip_grad_norm_"),
    "checkpoint_write": ("tasks.training.checkpoint", "MergeCheckpoints.save", "_fsync"),
    "specialist/<route>": ("tasks.training.specialist", "train_specialist", "log_eval"),
}

_UPDATE_CODES: set[CodeType] = set()  # tasks.training.distill.update_step's code (for the global clip_grad_norm_ wrapper)
_step = threading.local()  # the update_step frame whose "loss" hit was taken, and its action
_installed: list[bool] = [False]


def _on() -> bool:
    return bool(os.environ.get("OPD_FAULT"))


def _code(fn) -> CodeType:
    """The code object of a function, of the function a decorator (a Prefect task, functools.wraps) wraps."""
    return inspect.unwrap(getattr(fn, "fn", fn)).__code__


def _resolve(module: ModuleType, dotted: str):
    obj = module
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _wrap(owner, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace ``owner.name`` by ``make(real)`` (once: a wrapped function is left as it is)."""
    real = getattr(owner, name)
    if getattr(real, "_opd_fault", False):
        return
    wrapper = functools.update_wrapper(make(real), real)
    wrapper._opd_fault = True
    setattr(owner, name, wrapper)


def _patch_distill(m: ModuleType) -> None:
    import torch

    sample_code, update_code = _code(m.sample_batch), _code(m.update_step)
    _UPDATE_CODES.add(update_code)

    def verifier_rewards(real):
        def wrapper(*args, **kwargs):
            if _on() and sys._getframe(1).f_code is sample_code:
                fault("generate")
            return real(*args, **kwargs)
        return wrapper

    def chunked_objective(real):
        def wrapper(*args, **kwargs):
            res = real(*args, **kwargs)
            if not _on():
                return res
            caller = sys._getframe(1)
            if caller.f_code is not update_code:
                return res
            if getattr(_step, "frame", None) is not caller:  # this update_step's first objective: its one hit
                _step.frame, _step.action = caller, None
                _step.action = fault("loss")
            if _step.action == "nan":
                res = dataclasses.replace(res, loss=res.loss * float("nan"))
            return res
        return wrapper

    def clip_grad_norm_(real):
        def wrapper(*args, **kwargs):
            norm = real(*args, **kwargs)
            if _on() and sys._getframe(1).f_code in _UPDATE_CODES:
                _step.frame = _step.action = None
                fault("update")
            return norm
        return wrapper

    _wrap(m, "verifier_rewards", verifier_rewards)
    _wrap(m, "chunked_objective", chunked_objective)
    _wrap(torch.nn.utils, "clip_grad_norm_", clip_grad_norm_)


def _patch_checkpoint(m: ModuleType) -> None:
    save_code = _code(m.MergeCheckpoints.save)

    def _fsync(real):
        def wrapper(path, *args, **kwargs):
            real(path, *args, **kwargs)
            if _on() and sys._getframe(1).f_code is save_code and Path(path).name == "student.safetensors":
                fault("checkpoint_write")
        return wrapper

    def save(real):
        def wrapper(*args, **kwargs):
            out = real(*args, **kwargs)
            fault("checkpoint_saved")
            return out
        return wrapper

    _wrap(m, "_fsync", _fsync)
    _wrap(m.MergeCheckpoints, "save", save)


def _patch_specialist(m: ModuleType) -> None:
    train_code = _code(m.train_specialist)

    def log_eval(real):
        def wrapper(*args, **kwargs):
            if _on() and sys._getframe(1).f_code is train_code:
                fault(f"specialist/{kwargs['route'] if 'route' in kwargs else args[3]}")
            return real(*args, **kwargs)
        return wrapper

    _wrap(m, "log_eval", log_eval)


_PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "tasks.training.distill": _patch_distill,
    "tasks.training.checkpoint": _patch_checkpoint,
    "tasks.training.specialist": _patch_specialist,
}


class _PatchedLoader(importlib.abc.Loader):
    """The module's own loader, then its patch, before the import returns to the importer."""

    def __init__(self, loader: importlib.abc.Loader, patch: Callable[[ModuleType], None]):
        self.loader, self.patch = loader, patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = module.__spec__.loader = self.loader  # the module looks as if imported plainly
        self.loader.exec_module(module)
        self.patch(module)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if isinstance(finder, _PatchOnImport) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchedLoader(spec.loader, patch)
                return spec
        return None


def install() -> None:
    """Hook every fault point of this process (idempotent). The hooks read ``$OPD_FAULT`` at each call: without it
    they only call through."""
    if _installed[0]:
        return
    _installed[0] = True
    sys.meta_path.insert(0, _PatchOnImport())
    for name, patch in _PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])


def missing_anchors() -> list[str]:
    """The points whose production function no longer makes the call its hook wraps (imports the modules)."""
    import importlib

    missing = []
    for point, (module, function, name) in ANCHORS.items():
        if name not in _code(_resolve(importlib.import_module(module), function)).co_names:
            missing.append(f"{point}: {module}.{function} no longer calls {name}")
    return missing
