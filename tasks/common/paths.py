"""Where the project keeps its state. One root, ``$OPD_HOME`` or ``<project>/.opd``, holds everything a run writes:

    .opd/world/        the built-in world: its generated data and route spec, keyed by world config hash
    .opd/specs/        route specs given inline (the Prefect form's JSON, --spec '{...}'), each written once as
                       inline-<sha12>/routes.yaml, named by the hash of its text (tasks/specs/spec.py: write_inline_spec)
    .opd/prompt_sets/  rendered prompt sets (tasks/specs/prompt_set.py) built from route specs, keyed by their inputs
    .opd/models/       base, specialists and merged students (safetensors checkpoints)
    .opd/checkpoints/  merge checkpoints, one folder per merge, to resume after a kill (tasks/training/checkpoint.py)
    .opd/registry.json the teacher registry
    .opd/mlflow.db     MLflow tracking (sqlite) and .opd/mlartifacts/ its artifacts
    .opd/prefect/      PREFECT_HOME: Prefect's database, and in prefect/storage/ its task results and cache records
    .opd/matplotlib/   MPLCONFIGDIR: matplotlib's font cache
    .opd/huggingface/  HF_HOME: the Hugging Face hub and datasets caches

:func:`state_env` is what ``tasks/__init__.py`` puts in the environment (never over a value the user set) before
anything imports prefect, mlflow, matplotlib or datasets; :func:`state_cache_policy` keys cached tasks on this folder
too, so two checkouts never hand each other their worlds, bases or specialists.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # tasks/common/paths.py -> the checkout


def state_dir() -> Path:
    root = Path(os.environ.get("OPD_HOME", PROJECT_ROOT / ".opd")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    return root


def registry_path() -> Path:
    return Path(os.environ.get("OPD_REGISTRY", state_dir() / "registry.json")).resolve()


def models_dir() -> Path:
    return state_dir() / "models"


def world_dir() -> Path:
    return state_dir() / "world"


def prompt_sets_dir() -> Path:
    return state_dir() / "prompt_sets"


def specs_dir() -> Path:
    return state_dir() / "specs"


def write_atomic(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically and durably: a temporary file in the same folder, fsynced, then renamed
    over ``path`` and the folder fsynced, so a reader (another process, a crash halfway) sees the whole old file, the
    whole new one or none, and a committed write survives a power loss."""
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would outlive the rename
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
    return path


@contextmanager
def building(out: Path) -> Iterator[Path]:
    """Build a cached folder atomically: yields an empty ``<out>.tmp`` to write into; on success it gets a ``DONE``
    marker and replaces ``out``, so a folder with ``DONE`` is always whole (a crash leaves only the ``.tmp``)."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    yield tmp
    (tmp / "DONE").write_text("ok\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def state_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables (of those ``env`` lacks) that keep every tool's records under :func:`state_dir`: Prefect's home and
    result storage, matplotlib's cache, the Hugging Face caches; MLflow's usage telemetry off (it writes
    ``~/.config/mlflow/telemetry.json`` and calls home; ``MLFLOW_DISABLE_TELEMETRY=false`` opts in)."""
    root = state_dir()
    out = {
        "PREFECT_HOME": str(root / "prefect"),
        "MPLCONFIGDIR": str(root / "matplotlib"),
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }
    # Two names for one Prefect setting, and the first one set wins: a user's value under either name stands. Without
    # one, results go to $PREFECT_HOME/storage as read when prefect is imported: ~/.prefect/storage for any entry point
    # that imports prefect before this package.
    if not env.get("PREFECT_RESULTS_LOCAL_STORAGE_PATH") and not env.get("PREFECT_LOCAL_STORAGE_PATH"):
        results = str(root / "prefect" / "storage")
        out["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = out["PREFECT_LOCAL_STORAGE_PATH"] = results
    if not env.get("HF_HOME"):
        # Hub downloads and datasets' cache (HF_DATASETS_CACHE defaults to $HF_HOME/datasets) go to the state; a token
        # saved by `hf auth login` is still read from where the login put it.
        cache = Path(env.get("XDG_CACHE_HOME") or Path("~/.cache").expanduser())
        out["HF_HOME"] = str(root / "huggingface")
        out["HF_TOKEN_PATH"] = str(cache / "huggingface" / "token")
    return {k: v for k, v in out.items() if not env.get(k)}


def _state_key(task_ctx, inputs) -> str:
    return str(state_dir())


def state_cache_policy():
    """``INPUTS + TASK_SOURCE`` plus the state folder: a cached task's key names the folder its result lives in, so a
    result made for another checkout or ``$OPD_HOME`` is never handed back here, wherever Prefect keeps its records."""
    from prefect.cache_policies import INPUTS, TASK_SOURCE, CacheKeyFnPolicy

    return INPUTS + TASK_SOURCE + CacheKeyFnPolicy(cache_key_fn=_state_key)
