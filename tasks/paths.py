"""Where the project keeps its state. One root, ``$OPD_HOME`` or ``<project>/.opd``, holds everything a run writes:

    .opd/world/        tokenizer and prompt datasets (datasets.save_to_disk), keyed by world config hash
    .opd/models/       base, specialists and merged students (safetensors checkpoints)
    .opd/checkpoints/  merge checkpoints, one folder per merge, to resume after a kill (tasks/checkpoint.py)
    .opd/registry.json the teacher registry
    .opd/mlflow.db     MLflow tracking (sqlite) and .opd/mlartifacts/ its artifacts
    .opd/prefect/      PREFECT_HOME: Prefect's database, results and task cache
"""

from __future__ import annotations

import os
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent


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
