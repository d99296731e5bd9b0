"""Flow `pipeline`, the main job: read the route spec (the built-in world's unless --spec names yours), pre-train a
base (or take --base_model), train and register one specialist per route, merge them into one student by on-policy
distillation, and print the per-route retention table.

Run:  python -m flows.pipeline                 # default profile: 6 routes, <= 20 min on 2 CPU cores
      python -m flows.pipeline --profile quick # 3 routes, same code path, ~2 min
      python -m flows.pipeline --spec routes.yaml [--base_model PATH]   # your own routes (tasks/specs/spec.py)
      python -m flows.pipeline --opd.steps 400 --world.routes shift-low,shift-high ...  (any config field)
"""

from __future__ import annotations

import sys
import time

from prefect import flow

from flows.base import prepare_base
from flows.merge import merge
from flows.specialists import train_specialists
from flows.names import from_parameters, pipeline_name
from tasks.common.log import link, say
from tasks.config import PipelineConfig, pipeline_config
from teachers.preflight import preflight_pipeline
from tasks.specs.spec import spec_label
from tasks.evaluation.evaluate import below_base
from tasks.tracking.runs import format_retention_table, run_url, tracking_uri


@flow(name="pipeline", flow_run_name=from_parameters(PipelineConfig, pipeline_name))
def pipeline(cfg: PipelineConfig = PipelineConfig()) -> dict:
    """world -> base -> specialists -> registry -> OPD merge -> retention (each stage a subflow)."""
    t0 = time.perf_counter()
    routes = preflight_pipeline(cfg).routes  # every bad input refused here, all at once, before anything trains
    where = spec_label(cfg.spec) if cfg.spec else "the built-in world"
    say(f"[1/3] prepare base ({cfg.profile} profile, {where}: routes {', '.join(routes)})")
    base = prepare_base(cfg.pretrain())
    say(f"[2/3] train specialists ({len(routes)} routes)")
    scfg = cfg.specialists(base["uri"])
    teachers = train_specialists(scfg)
    # With below_min_accuracy skip, the routes whose specialist stayed below min_accuracy have no teacher: left out.
    kept = [r for r in routes if scfg.teacher_name(r) in teachers]
    untaught = [r for r in routes if r not in kept]
    say(f"[3/3] merge {len(teachers)} teachers into one student by on-policy distillation"
        + (f" (routes without a teacher, left out: {', '.join(untaught)})" if untaught else ""))
    result = merge(cfg.merge(base["uri"], teachers, routes=kept if untaught else None))
    minutes = (time.perf_counter() - t0) / 60
    table = result["rows"] + [{"route": r, "teacher": "none (below min_accuracy)", "base_accuracy": None,
                               "teacher_accuracy": None, "student_accuracy": None, "retention": None} for r in untaught]
    link(run_url(result["run_id"]), f"MLflow run of the merge ({result['mean_retention']:.3f} mean retention)",
         "pipeline-mlflow-run", "The merge's per-route retention, curves and student checkpoint")
    say(f"pipeline done in {minutes:.1f} min; mean retention {result['mean_retention']:.3f}\n"
        f"{format_retention_table(table)}\n"
        + "".join(f"  retention of {group}: {value:.3f}\n" for group, value in result["retention_by"].items())
        + "".join(f"{line}\n" for line in [below_base(result["rows"])] if line)
        + (f"routes without a teacher (their specialist stayed below min_accuracy {cfg.min_accuracy}), not merged: "
           f"{', '.join(untaught)}\n" if untaught else "")
        + f"MLflow run {result['run_id']} (experiment {cfg.experiment}) in {tracking_uri()}\n"
        f"  look at it: make ui-mlflow  (http://127.0.0.1:5000)")
    return {"base_uri": base["uri"], "teachers": teachers, **result, "minutes": minutes, "untaught": untaught}


def main(argv: list[str] | None = None) -> dict:
    from tasks.cli import parse_config, problems_of

    # Refused before Prefect starts, with every problem the preflight finds; the flow runs it again (UI, deployments).
    cfg = parse_config(argv, pipeline_config, __doc__, with_profile=True,
                       check=lambda c: problems_of(preflight_pipeline, c, say_warnings=False))
    return pipeline(cfg)


if __name__ == "__main__":
    from tasks.cli import run_main

    sys.exit(run_main(main))
