"""One way to report progress: the Prefect run logger inside a flow or task (shown in the UI and the console),
plain stdout outside one. (Prefect's ``log_prints`` is not used: it captures ``print`` calls that libraries such as
dill make to inspect code, which breaks datasets' fingerprinting and floods the log.)
"""

from __future__ import annotations

import logging


def say(message: str) -> None:
    if _in_run():
        from prefect.logging import get_run_logger

        get_run_logger().info(message)
        return
    print(message, flush=True)


def quiet_libraries() -> None:
    for name in ("datasets", "transformers", "mlflow", "alembic", "httpx"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _in_run() -> bool:
    from prefect.context import FlowRunContext, TaskRunContext

    return bool(FlowRunContext.get() or TaskRunContext.get())


class Progress:
    """A Prefect progress artifact (the bar on the run's Artifacts tab) updated as work advances; nothing outside a
    flow or task run."""

    def __init__(self, key: str, description: str):
        from prefect.artifacts import create_progress_artifact

        self.id = create_progress_artifact(0.0, key=key, description=description) if _in_run() else None

    def update(self, percent: float, description: str | None = None) -> None:
        if self.id is not None:
            from prefect.artifacts import update_progress_artifact

            update_progress_artifact(self.id, max(0.0, min(100.0, percent)), description=description)


def link(url: str, text: str, key: str, description: str = "") -> None:
    """A Prefect link artifact (for example to the MLflow run); nothing outside a flow or task run."""
    if _in_run():
        from prefect.artifacts import create_link_artifact

        create_link_artifact(url, link_text=text, key=key, description=description or None)
