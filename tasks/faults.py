"""Fault injection for the reliability tests only: make this process die, stop or fail at a named point, or turn a
loss into NaN, so that tests can check what a kill, a hung process or a non-finite step leaves behind
(tests/test_resume.py, tests/test_faults.py). Nothing happens unless ``$OPD_FAULT`` is set: never set it in a real run.

    OPD_FAULT="update:3=kill"               SIGKILL this process the 3rd time it reaches point ``update``
    OPD_FAULT="checkpoint_saved:1=stop"     SIGSTOP it after its first checkpoint (the test sends SIGCONT)
    OPD_FAULT="specialist/rev-low=raise"    raise InjectedFault (an OSError, so "transient") every time
    OPD_FAULT="loss:3=nan,loss:5-=nan"      the 3rd loss and every loss from the 5th on become NaN

A rule is ``POINT[:N|:N-][=ACTION]`` (no count: every time; ``N-``: from the Nth time on; default action ``kill``).
Points: ``generate`` (an on-policy batch was sampled, not yet scored), ``loss`` (a distillation loss computed),
``update`` (gradients computed, optimizer not stepped), ``checkpoint_write`` (half of a checkpoint's files
written), ``checkpoint_saved`` (a checkpoint committed), ``specialist/<route>`` (a specialist trained, not saved).
Hits are counted per process and point; the counts restart whenever ``$OPD_FAULT`` changes.
"""

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
