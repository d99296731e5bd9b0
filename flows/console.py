"""The console scripts ``pip install`` puts on the environment's path (``[project.scripts]`` in pyproject.toml): one
per verb a user runs, each exactly ``python -m <module>`` with the same flags, refusals and exit codes (0 done,
2 refused, with ``error: ...`` lines and no traceback; ``--debug`` shows it).

    opd-pipeline     python -m flows.pipeline     the whole job: base, specialists, merge, retention table
    opd-base         python -m flows.base         the built-in world's base student
    opd-specialists  python -m flows.specialists  train and register the specialists
    opd-register     python -m flows.register     register a teacher checkpoint (checked first)
    opd-teachers     python -m teachers           list / show / register / remove registry entries
    opd-merge        python -m flows.merge        merge registered teachers into a student
    opd-restore      python -m flows.restore      the next merge of a chain, restoring routes that dropped
    opd-evaluate     python -m flows.evaluate     a checkpoint's per-route accuracy and retention
    opd-compare      python -m flows.compare      merge runs side by side from MLflow

A console script calls its function and exits with what it returns, so each returns the exit code (a flow's
``main`` returns its result, which would be printed and read as failure)."""

from __future__ import annotations

import importlib
from typing import Callable


def _entry(module: str) -> Callable[[], int]:
    def run() -> int:
        from tasks.cli import run_main

        return run_main(importlib.import_module(module).main)

    run.__doc__ = f"``python -m {module}``, as a console script."
    return run


pipeline = _entry("flows.pipeline")
base = _entry("flows.base")
specialists = _entry("flows.specialists")
register = _entry("flows.register")
merge = _entry("flows.merge")
restore = _entry("flows.restore")
evaluate = _entry("flows.evaluate")
compare = _entry("flows.compare")


def teachers() -> int:
    """``python -m teachers`` (its ``main`` returns the exit code itself)."""
    from teachers.cli import main

    return main()
