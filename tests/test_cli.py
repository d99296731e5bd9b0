"""`--help` of every flow, generated from its config by tasks/cli.py: each field on one flag with its own description
and default, grouped by section, wrapped to the terminal (at most 100 columns); and every config field has a
description to show (the same text the Prefect UI run form shows as help).

    OMP_NUM_THREADS=1 python -m pytest tests/test_cli.py -q   (seconds: no flow runs)
"""

from __future__ import annotations

import re
from typing import Literal, get_args

import pytest
from pydantic import BaseModel, Field

import tasks.config
from tasks.cli import HELP_WIDTH, build_parser, parse_config, run_main
from tasks.config import OPDConfig, WorldConfig, flatten, pipeline_config

# Config fields of tasks/config.py allowed to lack a description (ClassName.field): none. The test below fails on a
# field without one, and on a line here that is no longer needed.
MISSING_DESCRIPTIONS: set[str] = set()


def help_entries(text: str) -> dict[str, tuple[str, str | None, str]]:
    """``{"--opd.steps": ("opd", "INT", "Optimizer steps ... (default 800)")}``: each flag's section (the group
    heading it is listed under), metavar and help text with its wrapped lines joined."""
    entries: dict[str, list] = {}
    section, flag = None, None
    for line in text.splitlines():
        if m := re.match(r"^(\S[^:]*):$", line):
            section, flag = m[1], None
        elif m := re.match(r"^  (--[\w.]+)(?: (\S+))?(?:\s{2,}(.*))?$", line):
            flag = m[1]
            assert flag not in entries, f"{flag} listed twice"
            entries[flag] = [section, m[2], m[3] or ""]
        elif flag and line.startswith(" " * 6) and line.strip():
            entries[flag][2] = f"{entries[flag][2]} {line.strip()}".strip()
        else:
            flag = None
    return {k: tuple(v) for k, v in entries.items()}


def pipeline_help(monkeypatch, columns: int) -> str:
    monkeypatch.setenv("COLUMNS", str(columns))  # what shutil.get_terminal_size reads first
    return build_parser(pipeline_config(), "Flow `pipeline`: the main job.", with_profile=True).format_help()


def own(model: type[BaseModel], name: str) -> str:
    return " ".join(model.model_fields[name].description.split())


def test_pipeline_help_gives_each_field_its_own_description_and_default_under_its_section(monkeypatch):
    cfg = pipeline_config()
    entries = help_entries(pipeline_help(monkeypatch, 100))
    assert set(entries) == {"--profile", "--debug"} | {f"--{k}" for k in flatten(cfg) if k != "profile"}
    assert entries["--opd.steps"] == ("opd", "INT", f"{own(OPDConfig, 'steps')} (default {cfg.opd.steps})")
    assert "on-policy stage" in entries["--opd.steps"][2]  # its own text, not TrainConfig's "Optimizer steps."
    assert entries["--base_train.steps"][2] != entries["--opd.steps"][2]
    assert entries["--world.train_size"] == ("world", "INT", f"{own(WorldConfig, 'train_size')} (default 3000)")
    assert entries["--world.routes"][:2] == ("world", "LIST")
    assert entries["--world.routes"][2].startswith(own(WorldConfig, "routes"))
    assert entries["--world.routes"][2].endswith('(default ["shift-low", "shift-high", "rev-low", "rev-high", '
                                                 '"sort-low", "sort-high"])')
    assert entries["--model.arch"] == ("model", "{llama,qwen2}", "transformers architecture of the base. (default llama)")
    section, metavar, text = entries["--opd.loss"]  # a long Literal: its choices in the help, not the metavar
    assert (section, metavar) == ("opd", "CHOICE")
    assert text.startswith(own(OPDConfig, "loss")) and "One of: reverse_kl, forward_kl, jsd," in text
    assert entries["--opd.max_new_tokens"][1:] == ("INT", f"{own(OPDConfig, 'max_new_tokens')} (default null)")
    assert entries["--opd.resume"][1] == "BOOL" and entries["--opd.resume"][2].endswith("(default true)")
    assert entries["--min_accuracy"][0] == "options"  # top-level fields sit with --profile and --debug
    assert entries["--specialist_rl.steps"][0] == "specialist_rl"


def test_pipeline_help_wraps_to_the_terminal_and_at_most_100_columns(monkeypatch):
    for columns, limit in ((300, HELP_WIDTH), (100, 98), (60, 58)):
        text = pipeline_help(monkeypatch, columns)
        long = [ln for ln in text.splitlines() if len(ln) > limit]
        assert not long, (columns, long)
        assert "shift-\n" not in text and "log-\n" not in text  # never broken inside a hyphenated word
    assert len(pipeline_help(monkeypatch, 300).splitlines()[0]) < 100  # usage: one line, not one flag per field


def test_help_of_a_small_config_follows_the_field_types():
    class Inner(BaseModel):
        """Inner section, from its docstring.

        A second paragraph not shown."""

        share: float = Field(0.1, description="Share of rows held out, 10% by default.")

    class Small(BaseModel):
        name: str = Field(description="Required name.")
        mode: Literal["a", "b"] = Field("a", description="Short choice.")
        cap: int | None = Field(None, description="Optional cap.")
        inner: Inner = Field(default_factory=Inner)
        described: Inner = Field(default_factory=Inner, description="Section described by its field.")

    text = build_parser(Small.model_construct(name="", mode="a", cap=None, inner=Inner(), described=Inner()),
                        "Flow `small`.").format_help()
    entries = help_entries(text)
    assert entries["--name"] == ("options", "STR", "Required name. (required)")
    assert entries["--mode"] == ("options", "{a,b}", "Short choice. (default a)")
    assert entries["--cap"] == ("options", "INT", "Optional cap. (default null)")
    assert entries["--inner.share"] == ("inner", "FLOAT", "Share of rows held out, 10% by default. (default 0.1)")
    assert "inner:\n  Inner section, from its docstring.\n" in text and "second paragraph" not in text
    assert "described:\n  Section described by its field.\n" in text


def test_help_through_parse_config_exits_0_with_the_descriptions(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "100")
    assert run_main(lambda a: parse_config(a, pipeline_config, "Flow `pipeline`.", with_profile=True), ["--help"]) == 0
    out = capsys.readouterr().out
    assert help_entries(out)["--opd.steps"][2] == f"{own(OPDConfig, 'steps')} (default 800)"


def _nested_models(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for a in get_args(annotation) for m in _nested_models(a)]  # list[Model], Model | None, ...


def config_models() -> list[type[BaseModel]]:
    """Every pydantic model of tasks/config.py, and every model its fields hold, recursively."""
    todo = [c for c in vars(tasks.config).values()
            if isinstance(c, type) and issubclass(c, BaseModel) and c.__module__ == tasks.config.__name__]
    seen: list[type[BaseModel]] = []
    while todo:
        model = todo.pop()
        if model not in seen:
            seen.append(model)
            todo += [m for f in model.model_fields.values() for m in _nested_models(f.annotation)]
    return seen


def test_every_config_field_has_a_description():
    models = config_models()
    assert {"PipelineConfig", "OPDConfig", "WorldConfig", "MergeConfig"} <= {m.__name__ for m in models}
    fields = {f"{m.__name__}.{name}": info for m in models for name, info in m.model_fields.items()}
    assert len(fields) > 100
    missing = {k for k, info in fields.items() if not (info.description or "").strip()}
    assert not missing - MISSING_DESCRIPTIONS, f"fields with no description: {sorted(missing - MISSING_DESCRIPTIONS)}"
    assert not MISSING_DESCRIPTIONS - missing, (
        f"described now (or gone): delete from MISSING_DESCRIPTIONS: {sorted(MISSING_DESCRIPTIONS - missing)}")


@pytest.mark.parametrize("columns", [40, 80])
def test_narrow_terminals_still_give_every_field_its_help(monkeypatch, columns):
    entries = help_entries(pipeline_help(monkeypatch, columns))
    assert entries["--opd.steps"][2] == f"{own(OPDConfig, 'steps')} (default 800)"
    assert all(text for _, _, text in entries.values())
