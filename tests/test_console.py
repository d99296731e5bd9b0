"""The console scripts of pyproject.toml, as installed (`make setup` runs `pip install -e .`): each names a
function of flows/console.py that runs its ``python -m`` module and returns an exit code (a console script exits
with what its function returns: a flow's result dict would be printed and read as failure); ``--help`` is 0, a
refused flag 2 with ``error:`` lines and no traceback; flows/console.py's table lists exactly these scripts and
modules. The scripts run as processes, as a user runs them (in-process, Prefect's console handler would keep a
test's captured stream after the test closes it)."""

import re
import shutil
import subprocess
import tomllib

import pytest

from tasks.common.paths import PROJECT_ROOT

SCRIPTS = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def _run(name, *argv):
    path = shutil.which(name)
    assert path, f"{name} is not installed on PATH: run make setup (pip install -e .) after changing pyproject.toml"
    return subprocess.run([path, *argv], capture_output=True, text=True, timeout=300, cwd=PROJECT_ROOT)


def test_the_table_in_flows_console_is_the_scripts_of_pyproject():
    from flows import console

    table = dict(re.findall(r"^\s+(opd-[\w-]+)\s+python -m ([\w.]+)", console.__doc__, flags=re.M))
    assert sorted(table) == sorted(SCRIPTS)
    for name, target in SCRIPTS.items():
        module, func = target.split(":")
        assert module == "flows.console", target
        doc = getattr(console, func).__doc__
        assert f"python -m {table[name]}" in doc, (name, doc)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_help_exits_zero(name):
    proc = _run(name, "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage:") and "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name", ["opd-merge", "opd-pipeline"])
def test_a_refused_flag_exits_two_without_a_traceback(name):
    proc = _run(name, "--opd.steps", "-3")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == ["error: config: opd.steps: Input should be greater than or equal to 1 (got '-3')"]
