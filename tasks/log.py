"""One way to report progress: the Prefect run logger inside a flow or task (shown in the UI and the console),
plain stdout outside one. (Prefect's ``log_prints`` is not used: it captures ``print`` calls that libraries such as
dill make to inspect code, which breaks datasets' fingerprinting and floods the log.)
"""

from __future__ import annotations

import logging


def say(message: str) -> None:
    try:
        from prefect.context import FlowRunContext, TaskRunContext
        from prefect.logging import get_run_logger

        if FlowRunContext.get() or TaskRunContext.get():
            get_run_logger().info(message)
            return
    except ImportError:
        pass
    print(message, flush=True)


def quiet_libraries() -> None:
    for name in ("datasets", "transformers", "mlflow", "alembic", "httpx"):
        logging.getLogger(name).setLevel(logging.WARNING)
