"""Test-only start-up hook (tests/faults): Python imports this module at start-up because the tests put its folder
first on ``PYTHONPATH``. With ``$OPD_FAULT`` set it installs the fault points (:func:`tests.faults.install`) before
anything imports the project; without it, it does nothing. Either way it then runs the ``sitecustomize`` it shadows,
if there is one."""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))

if os.environ.get("OPD_FAULT"):
    _root = os.path.dirname(os.path.dirname(os.path.dirname(_HERE)))  # tests/faults/site -> the repository
    if _root not in sys.path:
        sys.path.append(_root)
    from tests.faults import install

    install()

_next = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE])
if _next is not None and _next.loader is not None:
    _next.loader.exec_module(importlib.util.module_from_spec(_next))
