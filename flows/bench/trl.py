"""Benchmark: our OPD step (:func:`tasks.training.distill.opd_step`) against TRL's on-policy distillation trainer on the same
checkpoints, prompts, batch and machine, in one process: response tokens per second and seconds per step, printed as
a ratio (target: ours >= 1.5x TRL's tokens/s). Not a timed test: the numbers depend on the machine and its load.

TRL's trainer here is ``trl.DistillationTrainer`` (TRL 1.16; GKD's successor, always on-policy, i.e. GKD with
lmbda = 1) with ``beta = 1.0``, which is the reverse KL(student || teacher) in TRL's convention (as in its
``generalized_jsd_loss``: beta 0 forward KL, 1 reverse KL). Ours runs ``Objective(loss="reverse_kl")``. Both sample
from the student at temperature 1 without top-k/top-p up to ``max_new_tokens``, score every sequence with the
teacher in one forward, and take one AdamW step (this project's ``make_optimizer``, handed to TRL too) with the
gradient norm clipped to 1. Student and teacher are untrained checkpoints made with this project's code, one pair
per shape, each loaded fresh for each side; the prompts are the built-in world's, the same ones in the same order
for both. Steps alternate (one TRL step, then one of ours) so that load from other jobs hits both alike; the first
``warmup`` steps of each are not counted. Tokens are the response tokens actually generated (up to and including
EOS), counted per step.

Run:  python -m flows.bench.trl              # shapes 64x2x2 and 256x4x4, batch 16, 32 new tokens
      python -m flows.bench.trl --teacher spec-arith-steps --batch_size 8 --threads 2   # the real profile's pair
      python -m flows.bench.trl --quick      # one tiny shape, a few steps (seconds)
      python -m flows.bench.trl --shapes 128x3x4,512x6x8 --batch_size 32 --steps 10 --threads 2
      python -m flows.bench.trl --device cuda --dtype bf16 --shapes 256x4x4,512x6x8   # both on one GPU, bf16 AMP

``--device`` places both trainers' students and teachers (``auto``: the GPU when torch sees one); ``--dtype bf16`` is
mixed precision on both sides: our student keeps fp32 weights and computes under bf16 autocast
(:func:`tasks.modeling.device.place_trained`), TRL's gets ``bf16=True`` (its Trainer's autocast); both teachers are
held in bf16.

Needs TRL: ``pip install -e ".[bench]"`` (``make bench-env``). The table goes to stdout and to MLflow (experiment
``opd-bench``, run ``bench-trl-...``).
"""

from __future__ import annotations

import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field

from tasks.bench.helpers import (
    BenchOPDConfig,
    opd_steps,
    overlapped_opd_seconds,
    parse_bench_config,
    parse_shape,
    publish,
    save_checkpoint,
)
from tasks.common.log import say
from tasks.modeling.device import DeviceName, place_frozen, place_trained, resolve_device
from tasks.modeling.models import load_model, num_parameters
from tasks.modeling.rollout import compile_generation
from tasks.world.tokenizer import build_char_tokenizer
from tasks.training.sft import make_optimizer


class BenchTRLConfig(BenchOPDConfig):
    """Shapes, batch and step counts of the TRL comparison (student and teacher share each shape)."""

    warmup: int = Field(2, ge=1, description="Steps of each trainer not counted.")
    steps: int = Field(8, ge=1, description="Timed steps of each trainer.")
    device: DeviceName = Field("auto", description="Where both trainers' students and teachers run: auto = the GPU "
                               "when torch sees one, else the CPU; cpu; cuda (refused where torch sees no GPU).")
    dtype: Literal["fp32", "bf16"] = Field(
        "fp32", description="Compute precision of both trainers: fp32, or bf16 mixed precision (fp32 master weights; "
        "ours under bf16 autocast, TRL's with bf16=True) with both teachers held in bf16. (fp16 needs loss scaling, "
        "which our step does not do.)")
    teacher: str = Field(
        "", description="A registered LoRA specialist (registry name, e.g. spec-arith-answer): the real pair instead "
        "of --shapes: its base as the student, it as the teacher, its route's chat-rendered training prompts and "
        "verifier, the route's cap as max_new_tokens (run the real profile first).")


def bench_trl_config(profile: str = "default") -> BenchTRLConfig:
    if profile == "quick":
        return BenchTRLConfig(shapes=["64x2x2"], batch_size=4, max_new_tokens=8, warmup=1, steps=2)
    return BenchTRLConfig()


def trl_trainer_class():
    """``trl.DistillationTrainer`` that also records, per generation, its seconds and the response tokens it
    generated (the work is TRL's own, unchanged)."""
    from trl import DistillationTrainer

    class TimedDistillationTrainer(DistillationTrainer):
        generations: list[tuple[float, int]]

        def _generate(self, prompts):
            t0 = time.perf_counter()
            out = super()._generate(prompts)
            self.generations.append((time.perf_counter() - t0, sum(len(ids) for ids in out[1])))
            return out

    return TimedDistillationTrainer


# What TRL does differently from our step, printed with the table (checked in TRL 1.16's distillation_trainer.py).
TRL_DIFFERENCES = [
    "TRL settings changed from its defaults to do our work: bf16 as --dtype says (False in fp32, like ours), "
    "activation (gradient) checkpointing off (ours does not recompute the backbone), shuffle_dataset=False (same "
    "prompts, same order), logging off",
    "with --dtype bf16, ours runs rollouts, the forward and the backward under bf16 autocast (fp32 weights and AdamW "
    "state); TRL's bf16=True is accelerate's autocast around its Trainer's forward and backward (whether its "
    "generate runs under it is TRL's choice); both teachers are the same bf16 weights",
    "on a GPU every step of either trainer is timed from one torch.cuda.synchronize() to the next, so the kernels a "
    "step queued count in its own time, never in the other trainer's",
    "ours+compile is the same step as ours with opd.compile_generation (static KV cache, torch.compile'd decode "
    "step; its compiles fall in the warm-up steps, a recompile for a new shape would count), alternating with the "
    "other two",
    "ours+overlap is the merge loop's opd.overlap_generation: the next batch is generated in a background thread "
    "(from a copy of the student synced every step, so one update stale) while this step scores and updates; it runs "
    "after the alternating pair, on its own, timed as wall time over its steps. It can use a second core only when "
    "one is free: compare at the same --threads",
    "TRL's step time runs from on_step_begin to on_step_end of transformers' Trainer loop (generation, teacher, "
    "loss, backward, clip, AdamW, LR step); its dataloader fetch and log/save hooks are outside it",
    "ours also decodes and verifies every response (verifier reward) and keeps per-route diagnostics (entropies, "
    "top-k overlap, repetition); TRL logs the student entropy and completion lengths",
    "TRL's training forwards pass no position_ids, so left-padded prompts are scored at shifted positions (not those "
    "they were sampled at); ours derives positions from the attention mask (same cost, different numbers)",
    "TRL pads completions to the longest in the batch and projects every position through both heads (its chunked "
    "kernel skips masked positions only on Triton devices); ours also runs both full sequences and masks the loss",
]


def run_shape(cfg: BenchTRLConfig, shape: str, root: Path) -> dict:
    """One shape: fresh checkpoints of the built-in world's tokenizer, on its prompts (:func:`run_pair`)."""
    tok = build_char_tokenizer()
    return run_pair(cfg, save_checkpoint(tok, parse_shape(shape), cfg.seed, root / "student"),
                    save_checkpoint(tok, parse_shape(shape), cfg.seed + 1, root / "teacher"), tok, root)


def real_pair(cfg: BenchTRLConfig) -> tuple[BenchTRLConfig, str, str, object, tuple, dict]:
    """The real profile's pair for ``cfg.teacher`` (a registered LoRA specialist): its base as the student, its
    route's training prompts (chat-rendered, in the prompt set's order) and verifier, the route's cap as
    ``max_new_tokens``. Returns (cfg with that cap, student, teacher, tokenizer, data, verifiers)."""
    from tasks.bench.helpers import real_prompt_set
    from tasks.modeling.shared_base import adapter_of
    from tasks.specs.tokenizer import load_tokenizer
    from teachers.registry import TeacherRegistry

    registry = TeacherRegistry()
    if cfg.teacher not in registry.names():
        raise SystemExit(f"error: --teacher {cfg.teacher}: no such teacher in {registry.path}; registered: "
                         f"{registry.names()} (train the real profile's specialists first)")
    rec = registry.get(cfg.teacher)
    if (found := adapter_of(rec)) is None:
        raise SystemExit(f"error: --teacher {cfg.teacher} ({rec.model_uri}) is not a LoRA specialist: the student "
                         "is its base, which only an adapter names")
    base, ps = real_prompt_set(found[1])
    rows, n = ps.rows("train")[rec.route], cfg.batch_size * (cfg.warmup + cfg.steps)
    if len(rows["prompt"]) < n:
        raise SystemExit(f"error: route {rec.route} has {len(rows['prompt'])} training prompts, fewer than {n}")
    data = (rows["prompt"][:n], [rec.route] * n, rows["answer"][:n])
    return (cfg.model_copy(update={"max_new_tokens": ps.cap(rec.route)}), base, rec.model_uri, load_tokenizer(base),
            data, ps.verifiers)


def run_pair(cfg: BenchTRLConfig, student_path, teacher_path, tok, root: Path, data: tuple | None = None,
             verifiers: dict | None = None) -> dict:
    """One student / teacher pair: one TRL trainer and one of our students, alternating steps, on ``data``
    (default the built-in world's prompts). Returns per-trainer lists of (seconds, tokens, generation seconds) for
    the timed steps."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import DistillationConfig

    device = resolve_device(cfg.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def student_model():
        return place_trained(load_model(student_path), cfg.device, cfg.dtype)

    def teacher_model():
        return place_frozen(load_model(teacher_path), cfg.device, cfg.dtype)

    student = student_model()
    our_step = opd_steps(cfg, student, teacher_model(), tok, data, verifiers)
    # The same step with compiled generation (opd.compile_generation: static KV cache, torch.compile'd decode step).
    compiled_step = opd_steps(cfg, compile_generation(student_model()), teacher_model(), tok, data, verifiers)
    ours: list[tuple[float, int, float]] = []
    compiled: list[tuple[float, int, float]] = []
    trl: list[float] = []

    class Alternate(TrainerCallback):
        """Times each TRL step, then runs one of ours and one of ours with compiled generation."""

        def on_step_begin(self, args, state, control, **kwargs):
            sync()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            trl.append(time.perf_counter() - self.t0)
            t0 = time.perf_counter()
            for step, out in ((our_step, ours), (compiled_step, compiled)):
                t0 = time.perf_counter()
                stats = step(state.global_step - 1)
                sync()
                stats.seconds["step"] = time.perf_counter() - t0  # with its queued kernels (on a GPU)
                out.append((stats.seconds["step"], stats.tokens, stats.seconds["generate"]))

    trl_student = load_model(student_path).to(device)  # fp32 weights: TRL's bf16=True is its autocast
    n_steps = cfg.warmup + cfg.steps
    trl_optimizer, trl_scheduler = make_optimizer(trl_student, cfg.lr, 0.0, 0, n_steps)
    args = DistillationConfig(
        output_dir=str(root / "trl"), per_device_train_batch_size=cfg.batch_size, gradient_accumulation_steps=1,
        max_steps=n_steps, learning_rate=cfg.lr, max_grad_norm=1.0, beta=1.0, temperature=1.0, top_k=0, top_p=1.0,
        max_completion_length=cfg.max_new_tokens, bf16=cfg.dtype == "bf16", fp16=False,
        activation_checkpointing=False, use_cpu=device.type == "cpu", shuffle_dataset=False, dataloader_num_workers=0,
        report_to="none", logging_strategy="no", save_strategy="no", disable_tqdm=True, seed=cfg.seed,
    )
    with warnings.catch_warnings():  # transformers 5 deprecation notes on TRL's internal gradient_checkpointing reads
        warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*", category=FutureWarning)
        trainer = trl_trainer_class()(
            model=trl_student, teacher_model=teacher_model(), args=args,
            train_dataset=Dataset.from_dict({"prompt": (data or cfg.prompts())[0]}), processing_class=tok,
            optimizers=(trl_optimizer, trl_scheduler), callbacks=[Alternate()],
        )
        trainer.generations = []
        trainer.remove_callback(PrinterCallback)  # its end-of-training log line would interleave with our table
        torch.set_num_threads(cfg.threads)  # whatever the Trainer's setup did
        trainer.train()
    trl_steps = [(s, g[1], g[0]) for s, g in zip(trl, trainer.generations)]
    # Its background thread would run during TRL's steps if it alternated with them: it runs alone, afterwards.
    seconds, tokens = overlapped_opd_seconds(cfg, student_model(), teacher_model(), tok, data, verifiers)
    overlap = [(seconds / cfg.steps, tokens / cfg.steps, None)] * cfg.steps  # generation hidden: no own time
    return {"params": num_parameters(student), "ours": ours[cfg.warmup:], "ours+compile": compiled[cfg.warmup:],
            "trl": trl_steps[cfg.warmup:], "ours+overlap": overlap}


def where(cfg: BenchTRLConfig) -> str:
    """The device both trainers run on, in words (the GPU's name on CUDA)."""
    device = resolve_device(cfg.device)
    return f"{torch.cuda.get_device_name(device)} ({device})" if device.type == "cuda" else "the CPU"


NAMES = ("ours", "ours+compile", "ours+overlap", "trl")
HEADERS = ["shape", "params", "trainer", "tokens/step", "s/step", "gen s/step", "tokens/s", "x TRL"]


def bench_trl(cfg: BenchTRLConfig) -> dict:
    import trl

    torch.set_num_threads(cfg.threads)
    say(f"ours (tasks.training.distill.opd_step, reverse_kl) vs TRL {trl.__version__} DistillationTrainer (beta=1.0, on-policy)"
        f": batch {cfg.batch_size}, {cfg.warmup} warm-up + {cfg.steps} timed steps each, alternating, "
        f"{torch.get_num_threads()} torch thread(s), on {where(cfg)} in {cfg.dtype}; "
        + (f"the real profile's base as the student, {cfg.teacher} as the teacher, its route's prompts and cap"
           if cfg.teacher else f"up to {cfg.max_new_tokens} new tokens, untrained student and teacher"))
    rows, metrics = [], {}
    labels = [cfg.teacher] if cfg.teacher else cfg.shapes
    for label in labels:
        with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
            if cfg.teacher:  # the real profile's student and one of its specialists, on that route's prompts
                cfg, *pair = real_pair(cfg)
                res = run_pair(cfg, *pair[:3], Path(tmp), *pair[3:])
            else:
                res = run_shape(cfg, label, Path(tmp))
        rates = {}
        for name in NAMES:
            steps = res[name]
            seconds, tokens = (sum(x[k] for x in steps) for k in range(2))
            gen = None if steps[0][2] is None else sum(x[2] for x in steps)
            rates[name] = tokens / seconds
            rows.append([label, res["params"], name, tokens / len(steps), seconds / len(steps), None if gen is None else gen / len(steps),
                         rates[name], None])
            key = name.replace("+", "_")  # MLflow metric names take no '+'
            metrics[f"tokens_per_s/{key}/{label}"] = rates[name]
            metrics[f"step_s/{key}/{label}"] = seconds / len(steps)
        for row in rows[-len(NAMES):]:
            row[-1] = rates[row[2]] / rates["trl"]
        metrics[f"ours_over_trl/{label}"] = rates["ours"] / rates["trl"]
        metrics[f"ours_compile_over_trl/{label}"] = rates["ours+compile"] / rates["trl"]
        metrics[f"ours_overlap_over_trl/{label}"] = rates["ours+overlap"] / rates["trl"]
    ratios = [r[-1] for r in rows if r[2] == "ours"]
    compile_ratios = [r[-1] for r in rows if r[2] == "ours+compile"]
    overlap_ratios = [r[-1] for r in rows if r[2] == "ours+overlap"]
    verdict = "; ".join(
        f"{name}/TRL tokens per second: {', '.join(f'{s} {x:.2f}x' for s, x in zip(labels, rs))}"
        f" (target >= 1.5x: {'met' if min(rs) >= 1.5 else 'NOT met'})"
        for name, rs in (("ours", ratios), ("ours+compile", compile_ratios), ("ours+overlap", overlap_ratios)))
    run_id = publish(cfg, f"bench-trl-b{cfg.batch_size}-t{cfg.max_new_tokens}", HEADERS, rows,
                     [verdict, "differences:", *(f"- {d}" for d in TRL_DIFFERENCES)], metrics, "bench_trl",
                     {"trl": trl.__version__, "result": verdict, "device": where(cfg)})
    return {"headers": HEADERS, "rows": rows, "ratios": ratios, "compile_ratios": compile_ratios,
            "overlap_ratios": overlap_ratios, "run_id": run_id}


def main(argv: list[str] | None = None) -> dict:
    return bench_trl(parse_bench_config(argv, bench_trl_config, __doc__))


if __name__ == "__main__":
    from tasks.cli import run_main

    sys.exit(run_main(main))
