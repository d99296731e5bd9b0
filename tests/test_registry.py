"""Teacher registry: records, the JSON file, checkpoint registration. ``python -m pytest tests/test_registry.py -q``"""

from __future__ import annotations

import json
import multiprocessing
import shutil
import threading
from datetime import UTC, datetime
from pathlib import Path

import pytest
from pydantic import ValidationError
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from tasks.specs.tokenizer import save_tokenizer, tokenizer_fingerprint
from tasks.world.tokenizer import build_char_tokenizer
from tasks.world.domains import CHARSET, Route, all_routes
from teachers.registry import (
    IncompatibleTeacher,
    Provenance,
    RegistryError,
    TeacherNotFound,
    TeacherRecord,
    TeacherRegistry,
    registry_fingerprint,
)


def make_checkpoint(out: Path, tok: PreTrainedTokenizerBase) -> Path:
    """A tiny real checkpoint (weights, config, tokenizer) as the pipeline would save it."""
    import torch  # here, so that processes spawned from this module (the concurrency test) start faster

    from tasks.modeling.models import create_model, save_model

    torch.set_num_threads(1)
    model = create_model(tok, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, max_positions=32)
    return save_model(model, tok, out)


def make_record(name: str, route: str = "shift-high", **kw) -> TeacherRecord:
    return TeacherRecord(
        name=name,
        route=route,
        model_uri=kw.pop("model_uri", f"/ckpt/{name}"),
        tokenizer_fingerprint=kw.pop("tokenizer_fingerprint", "sha256:0123"),
        provenance=kw.pop("provenance", Provenance(source="test", data="unit")),
        **kw,
    )


@pytest.fixture(autouse=True)
def _isolated_state(tmp_path, monkeypatch):
    # Never touch the project's real .opd/ (state_dir() creates it on first use).
    monkeypatch.setenv("OPD_HOME", str(tmp_path / "opd"))
    monkeypatch.delenv("OPD_REGISTRY", raising=False)


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tok) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "shift-high", tok)


def test_round_trip_add_reload_remove(tmp_path):
    path = tmp_path / "reg" / "registry.json"
    reg = TeacherRegistry(path)
    assert reg.list() == []  # missing file is an empty registry
    records = [make_record("sort-low-a", "sort-low", eval_score=0.5), make_record("shift-high-b"),
               make_record("shift-high-a")]
    for r in records:
        reg.add(r)

    fresh = TeacherRegistry(path)
    assert [r.name for r in fresh.list()] == ["shift-high-a", "shift-high-b", "sort-low-a"]
    assert fresh.list() == sorted(records, key=lambda r: r.name)
    assert fresh.get("sort-low-a") == records[0]
    assert fresh.get("sort-low-a").provenance.created_at == records[0].provenance.created_at
    assert [r.name for r in fresh.for_route(Route("shift", "high"))] == ["shift-high-a", "shift-high-b"]
    assert fresh.for_route("rev-low") == []
    assert fresh.get("shift-high-a").route == "shift-high"

    doc = json.loads(path.read_text())
    assert doc["version"] == 1
    assert [t["name"] for t in doc["teachers"]] == ["shift-high-a", "shift-high-b", "sort-low-a"]

    assert fresh.remove("shift-high-b") == records[1]
    assert TeacherRegistry(path).names() == ["shift-high-a", "sort-low-a"]
    with pytest.raises(TeacherNotFound, match=r"available: \['shift-high-a', 'sort-low-a'\]"):
        fresh.get("shift-high-b")
    with pytest.raises(KeyError):
        fresh.remove("shift-high-b")


def test_duplicate_name_refused_unless_replace(tmp_path):
    reg = TeacherRegistry(tmp_path / "r.json")
    reg.add(make_record("t1", eval_score=0.1))
    with pytest.raises(RegistryError, match="'t1' is already in .*r.json; expected a new name"):
        reg.add(make_record("t1", eval_score=0.9))
    assert reg.get("t1").eval_score == 0.1
    reg.add(make_record("t1", eval_score=0.9), replace=True)
    assert [(r.name, r.eval_score) for r in reg.list()] == [("t1", 0.9)]


def test_record_validation():
    with pytest.raises(ValidationError, match="not a slug"):
        make_record("Add High")
    with pytest.raises(ValidationError, match="not a route name"):
        make_record("ok", route="-addhigh")
    with pytest.raises(ValidationError, match="not a route name"):
        make_record("ok", route="math/high")
    assert make_record("ok", route="gsm8k think").route == "gsm8k think"  # a spec's route name, not a world route
    with pytest.raises(ValidationError, match="less than or equal to 1"):
        make_record("ok", eval_score=1.5)
    with pytest.raises(ValidationError, match="extra"):
        TeacherRecord.model_validate({**make_record("ok").model_dump(), "plugin": "x"})
    naive = Provenance(created_at=datetime(2024, 1, 2, 3, 4, 5))
    assert naive.created_at == datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)


def test_register_checkpoint_fills_fingerprint(tmp_path, tok, ckpt):
    reg = TeacherRegistry(tmp_path / "r.json")
    rec = reg.register_checkpoint("shift-high-v1", "shift-high", ckpt, tok, eval_score=0.75,
                                  provenance=Provenance(source="test", base="base-uri"))
    assert rec.tokenizer_fingerprint == tokenizer_fingerprint(tok)
    assert rec.model_uri == str(ckpt.resolve())
    assert (rec.route, rec.eval_score, rec.provenance.base) == ("shift-high", 0.75, "base-uri")
    assert TeacherRegistry(tmp_path / "r.json").get("shift-high-v1") == rec

    # The reference tokenizer may be a path as well as an object.
    ref_dir = save_tokenizer(tok, tmp_path / "student-tok")
    rec2 = reg.register_checkpoint("shift-high-v2", Route("shift", "high"), str(ckpt), ref_dir)
    assert rec2.tokenizer_fingerprint == rec.tokenizer_fingerprint
    assert reg.names() == ["shift-high-v1", "shift-high-v2"]


def test_register_checkpoint_the_project_did_not_train(tmp_path, tok):
    # Any folder with an HF config and a compatible tokenizer is a teacher; architecture and weights are its own. (Its
    # stop token must be one the student can produce: gpt2's default, 50256, is not a token of this vocabulary.)
    foreign = tmp_path / "foreign"
    AutoConfig.for_model("gpt2", vocab_size=len(tok), n_embd=16, n_layer=1, n_head=2, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id).save_pretrained(foreign)
    save_tokenizer(tok, foreign)
    rec = TeacherRegistry(tmp_path / "r.json").register_checkpoint("gpt2-rev", "rev-low", foreign, tok)
    assert (rec.name, rec.route, rec.tokenizer_fingerprint) == ("gpt2-rev", "rev-low", tokenizer_fingerprint(tok))


def _other_tokenizer() -> PreTrainedTokenizerFast:
    """A char tokenizer with an extra token and a different EOS: looks alike, but its log-probs mean other things."""
    specials = ["<pad>", "<bos>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + list(CHARSET) + ["<extra>"])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="</s>",
                                   unk_token="<unk>")


def test_incompatible_tokenizer_refused_and_file_unchanged(tmp_path, tok):
    bad_ckpt = make_checkpoint(tmp_path / "bad", _other_tokenizer())
    path = tmp_path / "r.json"
    reg = TeacherRegistry(path)
    reg.add(make_record("existing"))
    before = path.read_bytes()

    with pytest.raises(IncompatibleTeacher) as info:
        reg.register_checkpoint("bad-teacher", "shift-high", bad_ckpt, tok)
    msg = str(info.value)
    assert "'bad-teacher'" in msg and str(bad_ckpt.resolve()) in msg
    assert "vocabularies differ" in msg and "eos_token differs" in msg
    assert any("only in teacher: ['</s>', '<extra>']" in p for p in info.value.problems)
    assert path.read_bytes() == before
    assert reg.names() == ["existing"]


def test_unloadable_checkpoint_and_bad_route_listed_together(tmp_path, tok):
    tok_only = save_tokenizer(tok, tmp_path / "tok-only")  # no config.json
    reg = TeacherRegistry(tmp_path / "r.json")
    with pytest.raises(IncompatibleTeacher) as info:
        reg.register_checkpoint("x", "no/route", tok_only, tok)
    assert len(info.value.problems) == 2
    assert "is not a route name" in info.value.problems[0]
    assert info.value.problems[1].startswith("config does not load")
    assert not (tmp_path / "r.json").exists()


def test_malformed_file_errors_name_the_file(tmp_path):
    path = tmp_path / "r.json"
    path.write_text('{\n  "version": 1,\n  "teachers": [\n')
    with pytest.raises(RegistryError, match=r"not valid JSON: .* at line 4 column 1") as info:
        TeacherRegistry(path).list()
    assert str(path) in str(info.value)

    good = make_record("ok").model_dump(mode="json")
    path.write_text(json.dumps({"version": 1, "teachers": [good, {**good, "name": "b", "eval_score": 2}]}))
    with pytest.raises(RegistryError, match=r"teachers\[1\]\.eval_score: Input should be less than or equal to 1"):
        TeacherRegistry(path).list()

    path.write_text(json.dumps({"version": 7, "teachers": []}))
    with pytest.raises(RegistryError, match="version 7 is not supported"):
        TeacherRegistry(path).list()


def test_concurrent_adds_lose_nothing(tmp_path):
    path = tmp_path / "r.json"

    def add_many(worker: int) -> None:
        reg = TeacherRegistry(path)  # each thread its own lock file handle, as separate processes would have
        for i in range(8):
            reg.add(make_record(f"w{worker}-{i}"))

    threads = [threading.Thread(target=add_many, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(TeacherRegistry(path).list()) == 32
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.json.lock"]  # no temp files left behind


def _register_from_process(registry: str, name: str, route: str, ckpt: str, student_tok: str, barrier) -> None:
    """One process of the concurrency test: wait for all the others, then check and register one checkpoint."""
    barrier.wait(timeout=300)
    TeacherRegistry(registry).register_checkpoint(name, route, ckpt, student_tok, provenance=Provenance(source="test"))


@pytest.mark.slow
def test_eight_processes_register_at_once_and_all_entries_land(tmp_path, tok, ckpt):
    # Separate processes (spawn: nothing shared but the file system) each run the full register_checkpoint at the
    # same moment; the flock on registry.json.lock serialises their read-modify-write.
    path = tmp_path / "registry.json"
    TeacherRegistry(path).add(make_record("already-there"))
    student_tok = save_tokenizer(tok, tmp_path / "student-tok")
    routes = [r.name for r in all_routes()[:8]]
    ckpts = [shutil.copytree(ckpt, tmp_path / f"ckpt-{i}") for i in range(8)]
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(8)
    procs = [ctx.Process(target=_register_from_process,
                         args=(str(path), f"proc-{i}", routes[i], str(ckpts[i]), str(student_tok), barrier))
             for i in range(8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    assert [p.exitcode for p in procs] == [0] * 8

    doc = json.loads(path.read_text())  # valid JSON, and every entry is there
    assert sorted(t["name"] for t in doc["teachers"]) == ["already-there"] + [f"proc-{i}" for i in range(8)]
    records = {r.name: r for r in TeacherRegistry(path).list()}
    for i in range(8):
        assert (records[f"proc-{i}"].route, records[f"proc-{i}"].model_uri) == (routes[i], str(ckpts[i].resolve()))
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".registry.json."))
    assert leftovers == []  # no temp files left behind


def test_registry_fingerprint_and_default_path(tmp_path, monkeypatch):
    a, b = make_record("a"), make_record("b")
    assert registry_fingerprint([a, b]) == registry_fingerprint([b, a])
    assert registry_fingerprint([a, b]) != registry_fingerprint([a, make_record("b", model_uri="/other")])
    assert registry_fingerprint([a]).startswith("sha256:") and len(registry_fingerprint([a])) == 23

    assert TeacherRegistry().path == (tmp_path / "opd" / "registry.json").resolve()
    monkeypatch.setenv("OPD_REGISTRY", str(tmp_path / "elsewhere.json"))
    assert TeacherRegistry().path == (tmp_path / "elsewhere.json").resolve()
