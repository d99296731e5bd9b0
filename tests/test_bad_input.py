"""Every bad input is refused before any model work, with a message naming the file, the field and what was expected.

    OMP_NUM_THREADS=1 python -m pytest tests/test_bad_input.py -q

Each flow case builds one bad input in its own project state and runs the body of the merge flow (``merge.fn``) or of
the pipeline flow: the preflight must refuse it while model construction and the flows' first real step are
booby-trapped (:func:`no_model_work`), so a refusal that came after a model load would fail the test. Config cases go
through the command-line parser, which refuses them before a flow starts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from tasks.cli import parse_config
from tasks.config import MergeConfig, OPDConfig, PipelineConfig, WorldConfig, pipeline_config
from tasks.world.data import MAX_ROW_TOKENS, build_world
from tasks.modeling.models import checkpoint_fingerprint
from tasks.preflight import InputError
from teachers.preflight import preflight_merge
from tasks.specs.tokenizer import SPECIALS, save_tokenizer
from tasks.world.tokenizer import build_char_tokenizer, route_tag_tokens
from tasks.world.domains import CHARSET
from teachers.registry import Provenance, RegistryError, TeacherRecord, TeacherRegistry
from tests.test_registry import make_checkpoint

ROUTES = ["rev-low", "sort-low"]
# sort-low problems of exactly 3 digits: a space of 1,000, small enough that two seeds' splits overlap.
WORLD = dict(routes=ROUTES, train_size=300, eval_size=40, min_len={"shift": 2, "rev": 2, "sort": 3, "count": 4},
             max_len={"shift": 4, "rev": 4, "sort": 3, "count": 6})


class ModelWork(BaseException):
    """Raised by the booby-trapped model constructors and flow steps (BaseException: nothing may swallow it)."""


@contextmanager
def no_model_work(monkeypatch):
    """Any model construction, and the first step after each flow's preflight, raises :class:`ModelWork`."""
    def trap(what):
        def boom(*args, **kwargs):
            raise ModelWork(what)
        return boom

    import flows.merge
    import flows.pipeline

    with monkeypatch.context() as m:
        m.setattr(AutoModelForCausalLM, "from_pretrained", trap("AutoModelForCausalLM.from_pretrained"))
        m.setattr(AutoModelForCausalLM, "from_config", trap("AutoModelForCausalLM.from_config"))
        m.setattr(flows.merge, "prompt_set_task", trap("merge: build prompt set"))
        m.setattr(flows.pipeline, "prepare_base", trap("pipeline: prepare base"))
        yield


def char_tokenizer(eos: str = "<eos>", extra: tuple[str, ...] = (), tags: bool = True) -> PreTrainedTokenizerFast:
    """The world's character tokenizer with one thing changed: the EOS token, extra vocab, or no route-tag specials."""
    vocab_list = list(SPECIALS.values()) + route_tag_tokens() + list(CHARSET) + list(extra)
    backend = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(vocab_list)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, padding_side="left", clean_up_tokenization_spaces=False,
                                   additional_special_tokens=route_tag_tokens() if tags else [],
                                   **{**SPECIALS, "eos_token": eos})


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-input")
    tok = build_char_tokenizer()
    student = make_checkpoint(root / "student", tok)
    return {"root": root, "tok": tok, "student": student, "student_fp": checkpoint_fingerprint(student)}


@dataclass
class Project:
    """One project state with a good merge setup: a student, one registered specialist per route, a config."""

    tmp: Path
    tok: PreTrainedTokenizerFast
    student: Path
    student_fp: str
    registry: TeacherRegistry
    teachers: dict[str, Path]
    cfg: MergeConfig

    def teacher(self, route: str, **provenance) -> TeacherRecord:
        """Register the checkpoint at ``teachers[route]`` as ``spec-<route>`` (checked; replaces)."""
        return self.registry.register_checkpoint(
            f"spec-{route}", route, self.teachers[route], self.tok, replace=True,
            provenance=Provenance(source="test", base=self.student_fp, **provenance))

    def write_record(self, route: str, **changes) -> None:
        """Overwrite ``spec-<route>``'s entry as it stands in the file, unchecked (what a hand edit or a checkpoint
        replaced after registration leaves behind)."""
        rec = self.registry.get(f"spec-{route}")
        self.registry.add(rec.model_copy(update=changes), replace=True)

    def prompt_file(self, route: str, text: str, suffix: str = ".jsonl") -> str:
        f = self.tmp / f"{route}{suffix}"
        f.write_text(text)
        self.cfg = self.cfg.model_copy(update={"world": WorldConfig(**{**WORLD, "prompt_files": {route: str(f)}})})
        return str(f)


@pytest.fixture
def project(tmp_path, monkeypatch, assets) -> Project:
    monkeypatch.setenv("OPD_HOME", str(tmp_path / "opd"))
    monkeypatch.setenv("OPD_REGISTRY", str(tmp_path / "opd" / "registry.json"))
    teachers = {r: shutil.copytree(assets["student"], tmp_path / f"ckpt-{r}") for r in ROUTES}
    p = Project(tmp_path, assets["tok"], assets["student"], assets["student_fp"], TeacherRegistry(), teachers,
                MergeConfig(world=WorldConfig(**WORLD), student_uri=str(assets["student"]), opd=OPDConfig(steps=1)))
    for r in ROUTES:
        p.teacher(r)
    return p


def refusal(monkeypatch, run: Callable[[], object]) -> InputError:
    with no_model_work(monkeypatch), pytest.raises(InputError) as info:
        run()
    return info.value


def assert_names(err: InputError, file: str, field: str, expected: str) -> None:
    """Some problem names the file, the field and the expectation (and the message shows all three)."""
    hits = [p for p in err.problems if file in p.file and field in p.field and expected in p.message]
    assert hits, f"no problem with file~{file!r} field~{field!r} expected~{expected!r} in:\n{err}"
    assert "expected" in hits[0].message or "should be" in hits[0].message  # pydantic says "Input should be ..."
    assert str(hits[0]) in str(err)


# ------------------------------------------------------------------------------------------------ merge flow cases
# Each: (setup of one bad input, file, field, expectation). The setup may return a new MergeConfig.


def _registry_text(text: str):
    def setup(p: Project):
        p.registry.path.write_text(text)
    return setup


def _registry_path_not_json(p: Project):
    os.environ["OPD_REGISTRY"] = str(p.tmp / "registry.txt")  # restored by the fixture's monkeypatch


def _duplicate_names(p: Project):
    doc = json.loads(p.registry.path.read_text())
    doc["teachers"][1]["name"] = doc["teachers"][0]["name"]
    p.registry.path.write_text(json.dumps(doc))


def _bad_eval_score(p: Project):
    doc = json.loads(p.registry.path.read_text())
    doc["teachers"][0]["eval_score"] = 1.5
    p.registry.path.write_text(json.dumps(doc))


def _teacher_folder_gone(p: Project):
    shutil.rmtree(p.teachers["sort-low"])


def _truncated_weights(p: Project):
    f = p.teachers["sort-low"] / "model.safetensors"
    f.write_bytes(f.read_bytes()[:40])


def _pickle_weights_only(p: Project):
    (p.teachers["sort-low"] / "model.safetensors").rename(p.teachers["sort-low"] / "pytorch_model.bin")


def _no_config(p: Project):
    (p.teachers["sort-low"] / "config.json").unlink()


def _remote_code_config(folder: Path) -> Path:
    """A config that names custom modelling code; the code would leave a marker file if it ever ran."""
    doc = json.loads((folder / "config.json").read_text())
    doc.update(model_type="opd-evil", auto_map={"AutoConfig": "configuration_evil.EvilConfig",
                                                 "AutoModelForCausalLM": "modeling_evil.EvilModel"})
    (folder / "config.json").write_text(json.dumps(doc))
    marker = folder / "REMOTE_CODE_RAN"
    (folder / "configuration_evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    return marker


def _teacher_asks_for_remote_code(p: Project):
    _remote_code_config(p.teachers["sort-low"])


def _teacher_tokenizer(tok: PreTrainedTokenizerFast):
    def setup(p: Project):
        save_tokenizer(tok, p.teachers["sort-low"])  # the checkpoint's tokenizer replaced after registration
    return setup


def _fingerprint_changed(p: Project):
    p.write_record("sort-low", tokenizer_fingerprint="sha256:0000000000000000")


def _vocab_too_small(p: Project):
    doc = json.loads((p.teachers["sort-low"] / "config.json").read_text())
    (p.teachers["sort-low"] / "config.json").write_text(json.dumps({**doc, "vocab_size": 10}))


def _other_architecture(p: Project):
    # A teacher whose registry entry says it was fine-tuned from the student, but a wider model sits at model_uri.
    shutil.rmtree(p.teachers["sort-low"])
    tok = p.tok
    from tasks.modeling.models import create_model, save_model

    save_model(create_model(tok, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=32, max_positions=32),
               tok, p.teachers["sort-low"])


def _not_a_causal_lm(p: Project):
    folder = p.teachers["sort-low"]
    AutoConfig.for_model("t5", vocab_size=64, d_model=16, num_layers=1, num_heads=2).save_pretrained(folder)


def _student(uri: str):
    def setup(p: Project):
        return p.cfg.model_copy(update={"student_uri": uri})
    return setup


def _opd(**fields):
    def setup(p: Project):
        return p.cfg.model_copy(update={"opd": p.cfg.opd.model_copy(update=fields)})
    return setup


def _student_missing(p: Project):
    return p.cfg.model_copy(update={"student_uri": str(p.tmp / "no-such-student")})


def _student_asks_for_remote_code(p: Project):
    student = shutil.copytree(p.student, p.tmp / "student-remote")
    _remote_code_config(student)
    return p.cfg.model_copy(update={"student_uri": str(student)})


def _route_without_teacher(p: Project):
    p.registry.remove("spec-sort-low")


def _named(*names: str):
    def setup(p: Project):
        return p.cfg.model_copy(update={"teachers": list(names)})
    return setup


def _two_on_one_route(p: Project):
    p.registry.add(p.registry.get("spec-rev-low").model_copy(update={"name": "spec-rev-low-b"}))
    return p.cfg.model_copy(update={"teachers": ["spec-rev-low", "spec-rev-low-b", "spec-sort-low"]})


def _prompts(text: str, suffix: str = ".jsonl"):
    def setup(p: Project):
        p.prompt_file("rev-low", text, suffix)
    return setup


def _prompt_file_missing(p: Project):
    p.prompt_file("rev-low", "")
    Path(p.cfg.world.prompt_files["rev-low"]).unlink()


def _parquet_without_problem(p: Project):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = p.tmp / "rev-low.parquet"
    pq.write_table(pa.table({"prompt": ["abc", "de"]}), f)
    p.cfg = p.cfg.model_copy(update={"world": WorldConfig(**{**WORLD, "prompt_files": {"rev-low": str(f)}})})


def world_prompt_set(world: WorldConfig, tokenizer: str) -> Path:
    """The prompt set the flows build for the built-in ``world`` rendered with ``tokenizer`` (what a specialist's
    registry provenance.data names)."""
    from tasks.specs.prompt_set import build_prompt_set
    from tasks.world.spec import write_world_spec

    return build_prompt_set(write_world_spec(world, build_world(world)), tokenizer)


def _teacher_saw_the_eval_problems(p: Project):
    # The sort-low specialist trained on the prompt set of the world of seed 0; the merge evaluates on seed 1's eval
    # problems, many of which are in seed 0's training split (a space of 1,000 problems).
    other = world_prompt_set(WorldConfig(**WORLD), str(p.student))
    p.teacher("sort-low", data=other.name)
    return p.cfg.model_copy(update={"world": WorldConfig(**{**WORLD, "seed": 1})})


def _world_too_small(p: Project):
    world = {**WORLD, "min_len": {**WORLD["min_len"], "sort": 1}, "max_len": {**WORLD["max_len"], "sort": 1}}
    return p.cfg.model_copy(update={"world": WorldConfig(**world)})


LONG_COUNT = "a:" + "abcd" * 10  # a valid count problem of 40 letters

MERGE_CASES = {
    "registry-malformed-json": (_registry_text('{"version": 1, "teachers": [\n'), "registry.json", "document",
                                "expected a JSON document"),
    "registry-wrong-version": (_registry_text('{"version": 9, "teachers": []}'), "registry.json", "version",
                               "expected 1"),
    "registry-not-an-object": (_registry_text("[]"), "registry.json", "document", "expected a JSON document"),
    "registry-path-not-json": (_registry_path_not_json, "registry.txt", "registry path", "expected a .json file"),
    "registry-duplicate-name": (_duplicate_names, "registry.json", "teachers[1].name", "expected unique names"),
    "registry-bad-eval-score": (_bad_eval_score, "registry.json", "teachers[0].eval_score",
                                "less than or equal to 1"),
    "teacher-checkpoint-missing": (_teacher_folder_gone, "ckpt-sort-low", "teacher 'spec-sort-low'.model_uri",
                                   "expected a folder"),
    "teacher-weights-truncated": (_truncated_weights, "model.safetensors", "teacher 'spec-sort-low'.model_uri",
                                  "expected a complete safetensors file"),
    "teacher-pickle-weights-only": (_pickle_weights_only, "ckpt-sort-low", "teacher 'spec-sort-low'.model_uri",
                                    "expected safetensors weights"),
    "teacher-config-missing": (_no_config, "config.json", "teacher 'spec-sort-low'.model_uri",
                               "expected the model's Hugging Face config"),
    "teacher-asks-for-remote-code": (_teacher_asks_for_remote_code, "config.json", "auto_map",
                                     "trust_remote_code: true granted in its registry entry"),
    "teacher-vocab-differs": (_teacher_tokenizer(char_tokenizer(extra=("<extra>",))), "ckpt-sort-low",
                              "(tokenizer)", "vocabularies differ"),
    "teacher-eos-differs": (_teacher_tokenizer(char_tokenizer(eos="<unk>")), "ckpt-sort-low", "(tokenizer)",
                            "eos_token differs"),
    "teacher-special-tokens-differ": (_teacher_tokenizer(char_tokenizer(tags=False)), "ckpt-sort-low",
                                      "(tokenizer)", "special tokens differ"),
    "teacher-fingerprint-changed": (_fingerprint_changed, "registry.json", "tokenizer_fingerprint",
                                    "expected the tokenizer it was registered with"),
    "teacher-vocab-too-small": (_vocab_too_small, "config.json", "vocab_size", "expected an embedding row"),
    "teacher-other-architecture": (_other_architecture, "ckpt-sort-low/config.json", "architecture",
                                   "expected the base's architecture"),
    "teacher-not-a-causal-lm": (_not_a_causal_lm, "config.json", "model_type", "expected a decoder-only causal LM"),
    "student-missing": (_student_missing, "no-such-student", "student_uri", "expected a folder"),
    "student-empty-no-base": (_student(""), "LATEST_BASE", "student_uri", "expected a checkpoint"),
    "student-uri-with-credentials": (_student("https://user:hunter2@hub.example/student"), "config", "student_uri",
                                     "expected a URI without them"),
    "student-asks-for-remote-code": (_student_asks_for_remote_code, "config.json", "auto_map",
                                     "the student never runs custom code"),
    "route-without-teacher": (_route_without_teacher, "registry.json", "routes",
                              "expected a registered teacher for every route"),
    "named-teacher-unknown": (_named("spec-rev-low", "nope"), "registry.json", "teachers",
                              "expected names of registered teachers"),
    "two-teachers-one-route": (_two_on_one_route, "registry.json", "teachers", "expected at most one named teacher per route"),
    "prompt-file-missing": (_prompt_file_missing, "rev-low.jsonl", "world.prompt_files[rev-low]",
                            "expected a .jsonl"),
    "prompt-file-wrong-suffix": (_prompts("problem\nabc\n", ".csv"), "rev-low.csv", "world.prompt_files[rev-low]",
                                 "expected .jsonl, .json (JSON Lines) or .parquet"),
    "prompt-set-empty": (_prompts("\n\n"), "rev-low.jsonl", "world.prompt_files[rev-low]",
                         "expected at least one JSON object"),
    "prompt-set-one-problem": (_prompts('{"problem": "abc"}\n{"problem": "abc"}\n'), "rev-low.jsonl",
                               "world.prompt_files[rev-low]", "expected at least 2"),
    "prompt-line-malformed": (_prompts('{"problem": "abc"}\n{"problem": "de"\n{"problem": "fg"}\n'),
                              "rev-low.jsonl", "line 2", "expected one JSON object per line"),
    "prompt-line-not-object": (_prompts('{"problem": "abc"}\n["de"]\n{"problem": "fg"}\n'), "rev-low.jsonl",
                               "line 2", "expected an object with a 'problem' field"),
    "prompt-line-missing-field": (_prompts('{"problem": "abc"}\n\n{"prompt": "de"}\n{"problem": "fg"}\n'),
                                  "rev-low.jsonl", "line 3", "expected a 'problem' field"),
    "prompt-line-not-a-string": (_prompts('{"problem": "abc"}\n{"problem": 42}\n'), "rev-low.jsonl", "line 2",
                                 "expected a string"),
    "prompt-line-wrong-domain": (_prompts('{"problem": "abc"}\n{"problem": "ab1"}\n'), "rev-low.jsonl", "line 2",
                                 "expected to match"),
    "prompt-parquet-no-problem-column": (_parquet_without_problem, "rev-low.parquet", "world.prompt_files[rev-low]",
                                         "expected a 'problem' column"),
    "eval-overlaps-teacher-train": (_teacher_saw_the_eval_problems, "prompts", "provenance.data",
                                    "expected held-out prompts it never saw"),
    "world-too-small-for-splits": (_world_too_small, "config", "world (route sort-low)",
                                   "expected a world whose prompt sets can be drawn"),
}
if not torch.cuda.is_available():  # a GPU named where there is none: refused before any model loads
    MERGE_CASES["teacher-device-cuda-without-gpu"] = (_opd(teacher_device="cuda"), "config", "opd.teacher_device",
                                                      "torch sees no CUDA GPU")


@pytest.mark.parametrize("case", sorted(MERGE_CASES))
def test_merge_flow_refuses_before_model_work(case, project, monkeypatch):
    setup, file, field, expected = MERGE_CASES[case]
    from flows.merge import merge

    cfg = setup(project) or project.cfg
    err = refusal(monkeypatch, lambda: merge.fn(cfg))
    assert_names(err, file, field, expected)


def test_prompt_row_too_long_reports_its_line(project, monkeypatch):
    # count-long rows: the trace of a 40-letter tally restates the tape at every step, far past the models' positions.
    f = project.tmp / "count-long.jsonl"
    f.write_text('{"problem": "a:abca"}\n{"problem": "b:bb"}\n' + json.dumps({"problem": LONG_COUNT}) + "\n")
    world = WorldConfig(**{**WORLD, "routes": ["count-long"], "prompt_files": {"count-long": str(f)}})
    err = refusal(monkeypatch, lambda: preflight_merge(project.cfg.model_copy(update={"world": world}),
                                                       say_warnings=False))
    assert_names(err, "count-long.jsonl", "line 3", f"expected at most {MAX_ROW_TOKENS} tokens")
    assert not any("line 1" in p.field or "line 2" in p.field for p in err.problems)


def test_every_problem_is_listed_not_only_the_first(project, monkeypatch):
    _teacher_folder_gone(project)
    project.prompt_file("rev-low", '{"problem": "abc"}\n{oops\n{"problem": "ab1"}\n{"problem": "de"}\n')
    err = refusal(monkeypatch, lambda: preflight_merge(project.cfg, say_warnings=False))
    fields = [p.field for p in err.problems]
    assert "line 2, row 2" in fields and "line 3, row 3" in fields
    assert "teacher 'spec-sort-low'.model_uri" in fields
    assert str(err).startswith(f"{len(err.problems)} problem(s) in the input, refused before any model work")


def test_good_input_passes_and_the_flow_goes_on_to_its_first_step(project, monkeypatch):
    # As the pipeline leaves it: specialists trained on the merge's own prompt set.
    prompt_set = world_prompt_set(project.cfg.world, project.cfg.student_uri)
    for r in ROUTES:
        project.teacher(r, data=prompt_set.name)
    report = preflight_merge(project.cfg, say_warnings=False)
    assert report.teachers == {"rev-low": "spec-rev-low", "sort-low": "spec-sort-low"} and report.warnings == []
    from flows.merge import merge

    with no_model_work(monkeypatch), pytest.raises(ModelWork, match="merge: build prompt set"):
        merge.fn(project.cfg)


def test_a_merge_of_some_routes_needs_teachers_for_those_only_and_refuses_an_unknown_route(project, monkeypatch):
    prompt_set = world_prompt_set(project.cfg.world, project.cfg.student_uri)
    project.teacher("rev-low", data=prompt_set.name)
    project.registry.remove("spec-sort-low")  # no teacher for sort-low
    err = refusal(monkeypatch, lambda: preflight_merge(project.cfg, say_warnings=False))
    assert_names(err, "registry.json", "routes", "expected a registered teacher for every route")
    report = preflight_merge(project.cfg.model_copy(update={"routes": ["rev-low"]}), say_warnings=False)
    assert report.routes == ["rev-low"] and report.teachers == {"rev-low": "spec-rev-low"}
    err = refusal(monkeypatch, lambda: preflight_merge(project.cfg.model_copy(update={"routes": ["rev-low", "nope"]}),
                                                       say_warnings=False))
    assert [(p.field, p.message.split(" in ")[0]) for p in err.problems] == [("routes", "no route(s) ['nope']")]


def test_teacher_for_a_route_no_prompt_uses_is_a_warning(project, monkeypatch, capsys):
    project.teacher("rev-low")
    project.registry.register_checkpoint("spec-shift-low", "shift-low", project.teachers["rev-low"], project.tok)
    cfg = project.cfg.model_copy(update={"teachers": ["spec-rev-low", "spec-sort-low", "spec-shift-low"]})
    report = preflight_merge(cfg)
    assert report.warnings == ["teacher 'spec-shift-low' serves route 'shift-low', which no prompt uses"]
    assert "warning: teacher 'spec-shift-low' serves route 'shift-low'" in capsys.readouterr().out


def test_granted_remote_code_is_the_only_way_past_auto_map(project):
    # Without the grant the checkpoint's code is never imported (the marker file would prove it ran).
    marker = _remote_code_config(project.teachers["sort-low"])
    with pytest.raises(InputError, match="auto_map"):
        preflight_merge(project.cfg, say_warnings=False)
    with pytest.raises(RegistryError, match="config does not load"):
        project.registry.register_checkpoint("evil", "sort-low", project.teachers["sort-low"], project.tok)
    assert not marker.exists()


def test_evaluate_refuses_a_base_that_is_not_there_before_prefect_starts(project, monkeypatch):
    from flows.evaluate import NO_BASE, EvaluateConfig, input_problems, main, resolve_base
    from tasks.common.paths import models_dir

    cfg = EvaluateConfig(world=WorldConfig(**WORLD), model_uri=str(project.student))
    gone = str(project.tmp / "no-base")
    (problem,) = input_problems(cfg.model_copy(update={"base_uri": gone}))
    assert (problem.file, problem.field) == (gone, "base_uri") and "no checkpoint folder there" in problem.message
    # Empty: the state's latest base, when there is one (none yet here); 'none': no base. Neither is refused.
    assert resolve_base("") is None and resolve_base(NO_BASE) is None
    assert input_problems(cfg) == [] and input_problems(cfg.model_copy(update={"base_uri": NO_BASE})) == []
    marker = models_dir() / "LATEST_BASE"
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(str(project.student))
    assert resolve_base("") == str(project.student) and input_problems(cfg) == []
    marker.write_text(gone)  # a recorded base that was deleted since
    assert [p.field for p in input_problems(cfg)] == ["base_uri"]
    with no_model_work(monkeypatch), pytest.raises(SystemExit, match=re.escape(f"base_uri: {gone}: no such folder")):
        main(["--model_uri", str(project.student), "--base_uri", gone, "--world.routes", ",".join(ROUTES)])


# ------------------------------------------------------------------------------------------------ pipeline cases


def test_pipeline_refuses_a_bad_registry_and_prompt_file_before_training(tmp_path, monkeypatch):
    # The specialists register into the registry only after all of them trained: a bad file must stop the run first.
    monkeypatch.setenv("OPD_HOME", str(tmp_path / "opd"))
    registry = tmp_path / "opd" / "registry.json"
    monkeypatch.setenv("OPD_REGISTRY", str(registry))
    registry.parent.mkdir(parents=True)
    registry.write_text("{not json")
    f = tmp_path / "p.jsonl"
    f.write_text('{"problem": "abc"}\n{"problem": "abc", \n')
    cfg = pipeline_config("quick", world={"prompt_files": {"rev-low": str(f)}})
    from flows.pipeline import pipeline

    err = refusal(monkeypatch, lambda: pipeline.fn(cfg))
    assert_names(err, "registry.json", "document", "expected a JSON document")
    assert_names(err, "p.jsonl", "line 2", "expected one JSON object per line")


# ------------------------------------------------------------------------------------------------ config cases


def _merge_defaults(profile: str = "default") -> MergeConfig:
    return pipeline_config(profile).merge("", [])


CLI_CASES = {
    "lr-zero": (["--opd.lr", "0"], "opd.lr", "greater than 0"),
    "lr-negative": (["--opd.cold_start_lr=-0.001"], "opd.cold_start_lr", "greater than 0"),
    "lambda-above-1": (["--opd.lmbda", "1.5"], "opd.lmbda", "less than or equal to 1"),
    "beta-below-0": (["--opd.beta", "-0.1"], "opd.beta", "greater than or equal to 0"),
    "beta-above-1": (["--opd.beta", "2"], "opd.beta", "less than or equal to 1"),
    # top_k 0 means the full vocabulary (documented on the field); below that nothing is meaningful.
    "top-k-negative": (["--opd.top_k", "-1"], "opd.top_k", "greater than or equal to 0"),
    "batch-size-zero": (["--opd.batch_size", "0"], "opd.batch_size", "greater than or equal to 1"),
    "loss-unknown": (["--opd.loss", "wasserstein"], "opd.loss", "Input should be 'reverse_kl'"),
    "route-loss-unknown": (["--opd.route_loss", '{"rev-low": "nope"}'], "opd.route_loss.rev-low",
                           "Input should be 'reverse_kl'"),
    "budget-unknown": (["--world.routes", "shift-medium"], "world.routes", "unknown budget 'medium'"),
    "template-budget-unknown": (["--world.budget_templates", '{"mid": "{problem}="}'], "world",
                                "names budget 'mid'"),
    "train-size-zero": (["--world.train_size", "0"], "world.train_size", "greater than or equal to 1"),
    "route-setting-for-unknown-route": (["--opd.route_weights", '{"count-low": 2}'], "opd.route_weights",
                                        "not in world.routes"),
}


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_config_refused_by_the_command_line_parser(case, monkeypatch):
    argv, field, expected = CLI_CASES[case]
    with no_model_work(monkeypatch), pytest.raises(SystemExit) as info:
        parse_config(argv, _merge_defaults, "t", with_profile=True)
    message = str(info.value)
    assert message.startswith("invalid configuration") and field in message and expected in message, message


def test_pipeline_config_cases_share_the_field_names():
    # The same refusal from the pipeline's own config (prefect.yaml parameters validate through it too).
    with pytest.raises(ValueError, match="opd.lr"):
        PipelineConfig.model_validate({"opd": {"lr": 0}})
