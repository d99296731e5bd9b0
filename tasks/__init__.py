"""Units of work (Prefect tasks) and the pure functions under them.

Importing this package first sets the environment the project's Prefect, MLflow and torch runs need on a small
machine, without overriding anything the user already set (see ../shared/notes/runtime-facts.md for why).
"""

import os as _os
from pathlib import Path as _Path

_state = _Path(_os.environ.get("OPD_HOME", _Path(__file__).resolve().parent.parent / ".opd")).resolve()
for _key, _value in {
    "PREFECT_HOME": str(_state / "prefect"),
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
    "TOKENIZERS_PARALLELISM": "false",
    # Tiny models on few cores: one intra-op thread per process is fastest and lets parallel workers not fight.
    "OMP_NUM_THREADS": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
}.items():
    _os.environ.setdefault(_key, _value)
_Path(_os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
