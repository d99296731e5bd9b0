"""Benchmark: the weight merges a user would try first, beside an OPD merge of the same LoRA specialists.

For the teachers of a finished merge (its student folder's ``retention.json`` names them, and the base, teacher and
student accuracies it measured), the specialists' peft adapters are combined by peft's ``add_weighted_adapter``
(``cat``: exactly the sum of their deltas, task arithmetic; ``ties``; ``dare_linear``; each adapter weight
``--scale``, ``--density`` for TIES and DARE; :func:`tasks.merging.weight_merge.merge_adapters`), merged into the base
and evaluated greedily on the same held-out prompts with each route's verifier. Printed: accuracy, retention and gain
recovered per route and method, the OPD student's row beside them, and the seconds each merge took.

Run:  python -m flows.bench.adapter_merges --merged .opd/models/merged/<run id> --spec tasks/gym/routes.yaml
      python -m flows.bench.adapter_merges --merged DIR --spec SPEC --methods task_arithmetic,ties --density 0.5
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from pydantic import Field, field_validator

from tasks.common.log import say
from tasks.common.table import format_table
from tasks.config import SpecInput, WorldConfig, _Config, known_names, spec_field
from tasks.merging.weight_merge import METHODS


class AdapterMergesConfig(_Config):
    """Which merge to compare against, and the weight merges to run."""

    merged: str = Field("", description="A merged student's folder (.opd/models/merged/<run id>): its "
                        "retention.json names the teachers and holds the OPD row; empty = the newest one here.")
    spec: SpecInput = spec_field()
    world: WorldConfig = Field(default_factory=WorldConfig, description="The built-in world, when spec is empty.")
    methods: list[str] = Field(default_factory=lambda: list(METHODS), description="Weight merges to run.")
    density: float = Field(0.5, gt=0, le=1, description="ties / dare: share of each adapter's entries kept.")
    scale: float = Field(1.0, gt=0, le=10, description="Weight of every adapter in the combination.")
    seed: int = Field(0, ge=0, description="dare: seed of the random drop.")

    @field_validator("methods")
    @classmethod
    def _methods(cls, v: list[str]) -> list[str]:
        return known_names(v, METHODS, "methods")


def newest_merge(folder: Path) -> Path:
    """The newest finished merge's student folder (one with its retention.json) under ``folder``."""
    done = sorted((p for p in folder.glob("*") if (p / "retention.json").is_file()), key=lambda p: p.stat().st_mtime)
    if not done:
        raise SystemExit(f"error: no finished merge in {folder}: run a merge first, or pass --merged DIR")
    return done[-1]


def compare(cfg: AdapterMergesConfig) -> list[dict]:
    """One row per (method, route): accuracy, retention and gain recovered, the OPD student's first."""
    from tasks.common.adapters import adapter_base
    from tasks.common.paths import models_dir
    from tasks.evaluation.evaluate import evaluate_prompt_set, gain_recovered, retention
    from tasks.common.adapters import saved_adapter
    from tasks.merging.weight_merge import merge_checkpoints
    from tasks.modeling.models import load_model
    from tasks.specs.prompt_set import load_prompt_set
    from tasks.specs.tokenizer import load_tokenizer
    from tasks.training.pretrain import prompt_set_task
    from teachers.registry import TeacherRegistry

    merged = Path(cfg.merged) if cfg.merged else newest_merge(models_dir() / "merged")
    opd_rows = json.loads((merged / "retention.json").read_text())
    registry = TeacherRegistry()
    experts = [registry.get(row["teacher"]).model_uri for row in opd_rows]
    adapters = [saved_adapter(e) for e in experts]
    if not all(adapters):
        raise SystemExit(f"error: not every teacher keeps a LoRA adapter (adapter/ in {experts}): peft's merges "
                         "need LoRA specialists (train.lora_rank > 0)")
    base = adapter_base(adapters[0])
    ps = load_prompt_set(prompt_set_task(cfg.spec, cfg.world, base))
    sets = ps.eval_sets()
    rows = [{"method": "opd", "merged": str(merged), **{k: r[k] for k in ("route", "base_accuracy", "teacher_accuracy")},
             "accuracy": r["student_accuracy"], "seconds": None} for r in opd_rows]
    for method in cfg.methods:
        t0 = time.perf_counter()
        out = merge_checkpoints(base, experts, method, models_dir() / "adapter_merges" / f"{method}-{merged.name}",
                                density=cfg.density, scale=cfg.scale, seed=cfg.seed)
        seconds = time.perf_counter() - t0
        scores = evaluate_prompt_set(load_model(out).eval(), load_tokenizer(out), ps, sets)
        for r in opd_rows:
            rows.append({"method": method, "route": r["route"], "base_accuracy": r["base_accuracy"],
                         "teacher_accuracy": r["teacher_accuracy"], "accuracy": scores[r["route"]].accuracy,
                         "seconds": seconds})
        say(f"{method}: " + ", ".join(f"{r['route']} {scores[r['route']].accuracy:.2f}" for r in opd_rows))
    for row in rows:
        row["retention"] = retention(row["accuracy"], row["teacher_accuracy"])
        row["gain_recovered"] = gain_recovered(row["accuracy"], row["teacher_accuracy"], row["base_accuracy"])
    return rows


def main(argv: list[str] | None = None) -> int:
    from tasks.cli import parse_config

    cfg = parse_config(argv, AdapterMergesConfig, __doc__)
    rows = compare(cfg)
    merged = Path(rows[0]["merged"])  # the folder compare() read (cfg.merged, or the newest merge)
    keys = ["method", "route", "base_accuracy", "teacher_accuracy", "accuracy", "retention", "gain_recovered", "seconds"]
    print(format_table(["method", "route", "base acc", "teacher acc", "acc", "retention", "gain rec.", "merge s"],
                       [[r[k] for k in keys] for r in rows]))
    out = merged / "adapter_merges.json"
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"rows written to {out}")
    return 0


if __name__ == "__main__":
    from tasks.cli import run_main

    sys.exit(run_main(main))
