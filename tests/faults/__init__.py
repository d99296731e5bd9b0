"""Fault injection for the reliability tests, and only for them: make a process die, stop or fail at a named point, or
turn a loss into NaN, so that tests can check what a kill, a hung process or a non-finite step leaves behind
(tests/test_resume.py, tests/test_faults.py, tests/test_checkpoint.py). The production code knows nothing of it:
:func:`install` wraps production functions at the points below, and nothing happens unless ``$OPD_FAULT`` is set.

    OPD_FAULT="update:3=kill"               SIGKILL this process the 3rd time it reaches point ``update``
    OPD_FAULT="checkpoint_saved:1=stop"     SIGSTOP it after its first checkpoint (the test sends SIGCONT)
    OPD_FAULT="specialist/rev-low=raise"    raise InjectedFault (an OSError, so "transient") every time
    OPD_FAULT="loss:3=nan,loss:5-=nan"      the 3rd loss and every loss from the 5th on become NaN

A rule is ``POINT[:N|:N-][=ACTION]`` (no count: every time; ``N-``: from the Nth time on; default action ``kill``).
Points (:mod:`tests.faults.points` says where each one is hooked):

    generate            an on-policy batch was sampled, not yet scored (tasks.training.distill.sample_batch)
    loss                a distillation loss computed, once per tasks.training.distill.update_step; ``nan`` makes it a real
                        NaN that flows through the backward pass
    update              gradients computed and clipped, optimizer not stepped (tasks.training.distill.update_step)
    checkpoint_write    part of a checkpoint's files written, not committed (tasks.training.checkpoint.MergeCheckpoints.save)
    checkpoint_saved    a checkpoint committed
    specialist/<route>  a specialist trained, not evaluated or saved (tasks.training.specialist.train_specialist)

Hits are counted per process and point; the counts restart whenever ``$OPD_FAULT`` changes.

How it gets in: in the pytest process tests/conftest.py calls :func:`install` (the rules are read at each hit, so a
test may set ``$OPD_FAULT`` at any time). Every other Python process the tests start finds :data:`SITE` first on its
``PYTHONPATH`` (tests/conftest.py puts it there for the whole session and in ``flow_env``): its ``sitecustomize.py``
calls :func:`install` at start-up when ``$OPD_FAULT`` is set, before anything imports the project.
"""

from pathlib import Path

from tests.faults.points import install, missing_anchors
from tests.faults.rules import InjectedFault, fault

SITE = Path(__file__).resolve().parent / "site"  # the sitecustomize.py folder subprocesses get first on PYTHONPATH

__all__ = ["SITE", "InjectedFault", "fault", "install", "missing_anchors"]
