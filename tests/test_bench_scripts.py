"""The OPD-step benchmarks run end to end on their ``--quick`` path (in a subprocess, as a user runs them) and print a
table of finite positive numbers. No timing is asserted: benchmarks report ratios, they are not timed tests."""

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
HAVE_TRL = importlib.util.find_spec("trl") is not None


def run_quick(module: str, *args: str) -> str:
    # conftest's OPD_HOME / MLFLOW_TRACKING_URI are in os.environ: the run logs into this session's store.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", module, "--quick", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def printed_table(stdout: str) -> list[dict[str, str]]:
    """The rows of the first table in ``stdout`` (header, dashed rule, rows; cells two or more spaces apart)."""
    lines = stdout.splitlines()
    rule = next(i for i, line in enumerate(lines) if re.fullmatch(r"-+( +-+)+", line.strip()))
    headers = re.split(r" {2,}", lines[rule - 1].strip())
    rows = []
    for line in lines[rule + 1:]:
        cells = re.split(r" {2,}", line.strip())
        if len(cells) != len(headers):
            break
        rows.append(dict(zip(headers, cells)))
    assert rows, stdout
    return rows


def assert_positive(rows: list[dict[str, str]], text_columns: set[str]) -> None:
    for row in rows:
        for column, cell in row.items():
            if column not in text_columns:
                value = float(cell)
                assert math.isfinite(value) and value > 0, (column, row)


def test_bench_step_quick_prints_a_breakdown():
    out = run_quick("flows.bench.step", "--dtypes", "fp32,bf16")
    rows = printed_table(out)
    assert [(r["shape"], r["dtype"]) for r in rows] == [("64x2x2", "fp32"), ("64x2x2", "bf16")]
    assert_positive(rows, {"shape", "dtype"})
    assert float(rows[0]["vs first"]) == 1.0 and float(rows[1]["vs first"]) != 1.0
    assert re.search(r"peak fp32 FLOP/s: [0-9.]+ GFLOP/s", out) and "MLflow run" in out


@pytest.mark.skipif(not HAVE_TRL, reason="trl is not installed in this environment (the comparison needs it): "
                    "`make bench-env` or pip install -e '.[bench]'")
def test_bench_trl_quick_prints_both_trainers():
    out = run_quick("flows.bench.trl")
    rows = printed_table(out)
    assert [(r["shape"], r["trainer"]) for r in rows] == [("64x2x2", "ours"), ("64x2x2", "ours+compile"),
                                                          ("64x2x2", "ours+overlap"), ("64x2x2", "trl")]
    assert rows[2]["gen s/step"] == "-"  # overlapped: generation has no time of its own
    assert_positive([rows[0], rows[1], rows[3]], {"shape", "trainer"})
    assert_positive([rows[2]], {"shape", "trainer", "gen s/step"})
    assert re.search(r"ours/TRL tokens per second: 64x2x2 [0-9.]+x", out) and "MLflow run" in out
    assert re.search(r"ours\+compile/TRL tokens per second: 64x2x2 [0-9.]+x", out)
    assert re.search(r"ours\+overlap/TRL tokens per second: 64x2x2 [0-9.]+x", out)


def test_bench_memory_compares_equal_losses_and_refuses_per_token_losses():
    """At V 16k, T 1k (one [T, V] fp32 tensor is 64 MB): both paths give the same loss and gradients, and the chunked
    path's peak is under half the naive one's (measured: 107 vs 706 MB); per-token losses (no full distributions to
    compare) are refused up front."""
    from flows.bench.memory import BenchMemoryConfig, bench_memory

    for loss in ("sampled_token", "sft"):
        with pytest.raises(ValueError, match="one log-prob per token"):
            BenchMemoryConfig(loss=loss)
    res = bench_memory(BenchMemoryConfig(vocab=16384, seq=1024, hidden=64, chunk_size=32, loss="jsd"))
    assert res["value_gap"] < 1e-5 and res["grad_gap"] < 1e-8
    assert 0 < res["chunked_mb"] < 0.5 * res["naive_mb"]
