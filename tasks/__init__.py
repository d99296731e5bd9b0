"""Units of work (Prefect tasks) and the pure functions under them.

Importing this package first sets the environment the project's Prefect, MLflow and torch runs need on a small
machine, without overriding anything the user already set (see ../shared/notes/runtime-facts.md for why), and keeps
every record those tools write under the state folder (``tasks.common.paths.state_env``). Prefect reads its settings when it
is imported, so every entry point imports this package before prefect: ``flows/__init__.py`` and
``teachers/__init__.py`` do it for their modules.
"""

import os as _os
import sys as _sys
import warnings as _warnings
from pathlib import Path as _Path

from tasks.common.paths import state_env as _state_env

_defaults = {
    **_state_env(_os.environ),
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
    "TOKENIZERS_PARALLELISM": "false",
    # Tiny models on few cores: one intra-op thread per process is fastest and lets parallel workers not fight.
    "OMP_NUM_THREADS": "1",
    # A merge computes on several threads (opd.threads): OpenMP's idle threads spin 10k rounds, not libgomp's 300k,
    # before they sleep, so a merge beside another busy process is not slowed many times over, while alone it keeps
    # nearly all of spinning's speed (flows.bench.step 128x3x4, 2 threads: alone 169 / 173 ms a step at 300k / 10k,
    # 334 ms never spinning; beside a busy process 1.0-2.0 s / 0.69-0.74 s / 0.28 s).
    "GOMP_SPINCOUNT": "10000",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
}
# Prefect settings this import adds: too late for a process that has imported prefect already.
_late = sorted(k for k in ("PREFECT_HOME", "PREFECT_RESULTS_LOCAL_STORAGE_PATH") if k in _defaults)
if "OMP_WAIT_POLICY" in _os.environ:  # the user's wait policy sets the spin itself (GOMP_SPINCOUNT would override it)
    del _defaults["GOMP_SPINCOUNT"]
for _key, _value in _defaults.items():
    _os.environ.setdefault(_key, _value)
_Path(_os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
if _late and "prefect" in _sys.modules:
    _warnings.warn(f"prefect was imported before the `tasks` package set {', '.join(_late)}: this process may keep "
                   "Prefect records outside the state folder; import tasks (or flows) before prefect", stacklevel=2)
