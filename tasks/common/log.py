"""One way to report progress: the Prefect run logger inside a flow or task (shown in the UI and the console),
plain stdout outside one. (Prefect's ``log_prints`` is not used: it captures ``print`` calls that libraries such as
dill make to inspect code, which breaks datasets' fingerprinting and floods the log.)
"""

from __future__ import annotations

import logging
import re

# ``scheme://user:password@`` (or ``scheme://token@``) and secret-named query parameters (``?token=...``).
_URL_CREDENTIALS = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]+@")
_SECRET_QUERY = re.compile(
    r"(?i)(?P<key>[?&](?:access_|auth_|api_|private_)?(?:token|key|apikey|api-key|password|passwd|secret|signature|sig)=)"
    r"[^&#\s]+"
)


def redact(text: str) -> str:
    """``text`` with URL credentials and secret query values replaced by ``***``: what may be logged (Prefect logs,
    MLflow params and tags) of a URI that might carry a token."""
    return _SECRET_QUERY.sub(r"\g<key>***", _URL_CREDENTIALS.sub(r"\g<scheme>***@", text))


def say(message: str) -> None:
    message = redact(message)  # every Prefect log line of the project passes here
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

        # A link keeps no credentials at all (the browser asks for them); the text is redacted like a log line.
        create_link_artifact(_URL_CREDENTIALS.sub(r"\g<scheme>", url), link_text=redact(text), key=key,
                             description=redact(description) if description else None)
