"""Flow `merge`: on-policy distillation of the routed specialist teachers into one student, per-route retention in
MLflow.

Run:  python -m flows.merge [--profile quick] [--student_uri PATH] [--teachers '["spec-shift-low", ...]']
                            [--opd.steps 300] [--opd.batch_size 64] [--experiment opd-merge] ...
      python -m flows.merge --profile quick --opd.nproc 2   # the student update on 2 processes (FSDP, torchrun)
      python -m flows.merge --opd.nproc 16 --opd.nnodes 2 --opd.rdzv_endpoint HOST:29400
          # 8 processes on each of 2 machines: it prints the torchrun command the other machine runs

The merge checkpoints itself every --opd.checkpoint_every steps: after a kill or a failure, run the same command
again and it resumes from its last checkpoint into the same MLflow run (--opd.resume false starts over instead).
"""

from __future__ import annotations

import sys
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.artifacts import create_table_artifact

from flows.names import current_run_name, from_parameters, merge_name
from tasks.common.log import link, say
from tasks.config import MergeConfig, pipeline_config
from tasks.evaluation.evaluate import below_base, mean_retention
from tasks.merging.merge import TrackingUnavailable, mark_failed, open_merge_run, run_merge
from teachers.preflight import preflight_merge
from tasks.training.pretrain import latest_base, prompt_set_task
from tasks.specs.prompt_set import load_prompt_set
from tasks.tracking.runs import format_retention_table, run_url, tracking_uri
from teachers.registry import TeacherRegistry
from teachers.router import Router


@task(name="route-teachers", cache_policy=NO_CACHE)
def route_teachers(cfg: MergeConfig, prompt_set: str) -> Router:
    """Map every route of the prompt set to its registered teacher(s) (``cfg.teachers``, else the spec's per-route
    ``teacher`` or ``teachers``) and print the coverage report (or fail naming the routes that have teachers)."""
    ps = load_prompt_set(prompt_set, cfg.routes)
    router = Router.for_merge(TeacherRegistry(), ps.routes, cfg.teachers, ps.spec)
    counts = {r: len(d) for r, d in ps.rows("train").items()}
    say("routing coverage:\n" + router.format_coverage(counts))  # its warnings were said by the preflight
    return router


@flow(name="merge", flow_run_name=from_parameters(MergeConfig, merge_name))
def merge(cfg: MergeConfig = MergeConfig()) -> dict:
    """Route -> OPD loop -> retention table; returns the MLflow run id, student URI and the table rows."""
    preflight_merge(cfg)  # every bad input refused here, all at once, before any model is loaded
    if not cfg.student_uri:
        cfg = cfg.model_copy(update={"student_uri": latest_base()})
    prompt_set = prompt_set_task(cfg.spec, cfg.world, cfg.student_uri)
    router = route_teachers(cfg, prompt_set)
    run_name = current_run_name(merge_name(cfg))
    run_id, checkpoints = open_merge_run(cfg, router, run_name, prompt_set)  # a new run, or the one a killed attempt began
    try:
        say(f"MLflow run {run_id} ({run_name}) at {tracking_uri()}")
        link(run_url(run_id), f"MLflow run {run_name}", "merge-mlflow-run",
             "Per-route metrics, retention table, student")
        result = run_merge.with_options(retries=cfg.retries, retry_delay_seconds=cfg.retry_delay_seconds)(
            cfg, prompt_set, router, run_id, str(checkpoints.root))
    except TrackingUnavailable:
        raise  # MLflow is down: marking the run would only wait for it again; a rerun resumes the run
    except BaseException:
        mark_failed(run_id)  # a crashed merge must not look like a run still in progress
        raise
    finally:
        checkpoints.release()
    table = format_retention_table(result["rows"])
    mean = mean_retention(result["rows"])
    say(f"retention per route (mean {mean:.3f}):\n{table}")
    if warning := below_base(result["rows"]):
        say(warning)
    if result["retention_by"]:
        say("retention per label (mean over its routes): "
            + ", ".join(f"{group} {value:.3f}" for group, value in result["retention_by"].items()))
    create_table_artifact(table=result["rows"], key="retention", description=f"MLflow run {run_id}")
    return {**result, "mean_retention": mean}


def main(argv: list[str] | None = None) -> dict:
    from tasks.cli import parse_config, problems_of

    # Refused before Prefect starts, with every problem the preflight finds; the flow runs it again (UI, deployments).
    cfg = parse_config(argv, lambda profile="default": pipeline_config(profile).merge("", []), __doc__,
                       with_profile=True, check=lambda c: problems_of(preflight_merge, c, say_warnings=False))
    return merge(cfg)


if __name__ == "__main__":
    from tasks.cli import run_main

    sys.exit(run_main(main))
