"""Many teachers in one merge: the pool's scheduling (pure), and the real merge loop over the 12 routes of the
built-in world with fewer resident teachers than teachers, on tiny untrained checkpoints built by the teacher
benchmark's own setup (flows/bench/teachers.py), in this process."""

from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from flows.bench.teachers import BenchTeachersConfig, bench_rows, prepare_bench, run_case
from tasks.modeling.models import create_model, load_model, save_model
from tasks.modeling.teacher_pool import TeacherPool
from tasks.world.tokenizer import build_char_tokenizer
from tasks.tracking.runs import tracking_uri

TINY = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}


def test_resident_teachers_score_first_so_a_step_loads_each_missing_teacher_once():
    loaded = []
    pool = TeacherPool([f"t{i}" for i in range(6)], lambda name: loaded.append(name) or torch.nn.Linear(1, 1),
                       max_resident=2)
    pool["t4"], pool["t1"]
    groups = {f"t{i}": [i] for i in range(6)}
    order = list(pool.resident_first(groups))
    assert order == ["t4", "t1", "t0", "t2", "t3", "t5"]  # resident (least recent first), then the rest in order
    assert pool.resident_first({"t1": [0], "t3": [1]}) == {"t1": [0], "t3": [1]}
    for name in order:
        pool[name]
    assert pool.loads == 2 + 4 and pool.evictions == 4 and list(pool.resident) == ["t3", "t5"]


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's memory maps (Linux)")
def test_an_evicted_teacher_releases_its_checkpoint_even_while_its_head_is_kept(tmp_path):
    tok = build_char_tokenizer()
    for name in ("t0", "t1"):
        save_model(create_model(tok, seed=1, **TINY), tok, tmp_path / name)
    pool = TeacherPool(["t0", "t1"], lambda name: load_model(tmp_path / name), max_resident=1)
    head = pool["t0"].get_output_embeddings()  # what scoring keeps until the student's update
    assert str(tmp_path / "t0") not in Path("/proc/self/maps").read_text()  # its weights are its own, not the file's
    pool["t1"]
    assert pool.evictions == 1 and head.weight.shape[0] == len(tok)


@pytest.fixture(scope="module")
def bench():
    # 120 prompts a step over 12 routes: every teacher is needed at every step (seeded, so not left to chance).
    cfg = BenchTeachersConfig(teacher_counts=[12], max_resident=3, steps=2, batch_size=120, max_new_tokens=4,
                              prompts_per_route=20, student=TINY, teacher_model=TINY, experiment="test-many-teachers")
    return cfg, prepare_bench(cfg)


def test_twelve_teacher_merge_keeps_at_most_max_resident_loaded(bench):
    cfg, setup = bench
    out = run_case(cfg, setup, 12, 3)
    # Warm-up step: 12 loads, 9 evictions. Then each step scores its 3 resident teachers first and loads the other 9.
    assert out["loads_per_step"] == 9
    assert (out["loads"], out["evictions"]) == (12 + 9 * cfg.steps, 9 + 9 * cfg.steps)
    client = MlflowClient(tracking_uri())
    resident = [m.value for m in client.get_metric_history(out["run_id"], "teachers/resident")]
    assert len(resident) == 1 + cfg.steps and max(resident) == 3
    assert client.get_run(out["run_id"]).data.params["opd.max_resident_teachers"] == "3"
    everyone = run_case(cfg, setup, 12, 0)  # no limit: each teacher loaded once, none evicted
    assert (everyone["loads"], everyone["evictions"]) == (12, 0)
    rows = bench_rows([everyone, out])
    assert rows[0][1] == "all" and rows[1][1] == 3 and rows[0][3] == 1.0
