"""The ``$OPD_FAULT`` rules (moved here from the production package: fault injection is test-only): which hit of which
point does what. :mod:`tests.faults.points` calls :func:`fault` at each point; see :mod:`tests.faults` for the syntax."""

from __future__ import annotations

import os
import signal
import threading

_lock = threading.Lock()
_counts: dict[str, int] = {}
_spec_seen: list[str] = [""]


class InjectedFault(OSError):
    """The error a ``raise`` rule throws (an OSError: retry policies treat it as transient)."""


def fault(point: str) -> str | None:
    """Apply the first ``$OPD_FAULT`` rule matching this hit of ``point``: kill, stop or raise here; returns the
    action for the caller to apply (``nan``), or None when no rule matches."""
    spec = os.environ.get("OPD_FAULT", "")
    if not spec:
        return None
    with _lock:
        if spec != _spec_seen[0]:
            _counts.clear()
            _spec_seen[0] = spec
        n = _counts[point] = _counts.get(point, 0) + 1
    for rule in spec.split(","):
        target, _, action = rule.strip().partition("=")
        name, _, count = target.partition(":")
        if name != point:
            continue
        if count and not (n >= int(count[:-1]) if count.endswith("-") else n == int(count)):
            continue
        action = action or "kill"
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif action == "raise":
            raise InjectedFault(f"injected fault at {point} (hit {n}, OPD_FAULT={spec!r})")
        return action
    return None
