"""The console scripts of pyproject.toml: each names a function of flows/console.py that runs its ``python -m``
module and returns an exit code (a console script exits with what its function returns: a flow's result dict
would be printed and read as failure); ``--help`` is 0, a refused flag 2 with ``error:`` lines and no traceback;
flows/console.py's table lists exactly these scripts and modules."""

import importlib
import re
import sys
import tomllib

import pytest

from tasks.common.paths import PROJECT_ROOT

SCRIPTS = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def _run(name, argv, monkeypatch):
    module, func = SCRIPTS[name].split(":")
    monkeypatch.setattr(sys, "argv", [name, *argv])
    return getattr(importlib.import_module(module), func)()


def test_the_table_in_flows_console_is_the_scripts_of_pyproject():
    from flows import console

    table = dict(re.findall(r"^\s+(opd-[\w-]+)\s+python -m ([\w.]+)", console.__doc__, flags=re.M))
    assert sorted(table) == sorted(SCRIPTS)
    for name, target in SCRIPTS.items():
        module, func = target.split(":")
        assert module == "flows.console", target
        doc = getattr(console, func).__doc__
        assert f"python -m {table[name]}" in doc, (name, doc)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_help_exits_zero_with_an_int(name, monkeypatch, capsys):
    code = _run(name, ["--help"], monkeypatch)
    assert code == 0 and type(code) is int
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["opd-merge", "opd-pipeline"])
def test_a_refused_flag_exits_two_without_a_traceback(name, monkeypatch, capsys):
    code = _run(name, ["--opd.steps", "-3"], monkeypatch)
    err = capsys.readouterr().err
    assert code == 2 and "error:" in err and "opd.steps" in err
    assert "Traceback" not in err
