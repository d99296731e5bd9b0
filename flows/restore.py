"""Flow `restore`: the next merge of a chain, with earlier checkpoints as teachers for the routes the chain lost
(restoration, GLM-5's practice; tasks/merging/restore.py says how the checkpoint is chosen).

After merge k (the last MLflow run of ``--chain``), every route whose retention is below ``--restore_below`` and
that an earlier checkpoint of the chain (an earlier merge's student, or the chain's base) scored higher on gets that
checkpoint, registered as a teacher of the route (``restore-<route>-<source>``), in merge k+1, which starts from
merge k's student; the other routes keep merge k's teachers. Merge k+1's MLflow run records the chain (tags
``chain.runs``, ``chain.parent``, ``restore.<route>``). Nothing to restore: no merge.

Run:  python -m flows.restore --chain '["<merge 1 run id>", "<merge 2 run id>"]' [--restore_below 0.9] [--opd.steps 300]
"""

from __future__ import annotations

import sys

from prefect import flow
from pydantic import Field

from flows.names import from_parameters
from tasks.common.log import say
from tasks.config import MergeConfig, pipeline_config
from tasks.merging.restore import next_teachers, read_chain, restoration_plan


class RestoreConfig(MergeConfig):
    """Flow `restore`: merge k+1 of a chain, restoring the routes merge k lost. Its merge fields are merge k+1's
    (student_uri empty = merge k's student; teachers empty = merge k's, restored routes replaced)."""

    chain: list[str] = Field(default_factory=list, description="MLflow run ids of the chain's merges, oldest first; "
                             "the last is merge k, whose student is restored (required).")
    restore_below: float = Field(0.9, gt=0, le=10, description="A route of merge k retained below this is restored "
                                 "when an earlier checkpoint of the chain scored higher on it.")


def restore_name(cfg: RestoreConfig) -> str:
    return f"restore-{cfg.chain[-1][:8] if cfg.chain else 'chain'}"


@flow(name="restore", flow_run_name=from_parameters(RestoreConfig, restore_name))
def restore(cfg: RestoreConfig) -> dict:
    """Plan the restorations, register their teachers, run merge k+1 and record the chain in its MLflow run."""
    from mlflow.tracking import MlflowClient

    from flows.merge import merge
    from tasks.tracking.runs import tracking_uri
    from teachers.registry import Provenance, TeacherRegistry

    if not cfg.chain:
        raise ValueError("chain: expected the MLflow run ids of the chain's merges, oldest first (none given)")
    client = MlflowClient(tracking_uri())
    chain = read_chain(cfg.chain, client)
    last = chain[-1]
    plan = restoration_plan(chain, cfg.restore_below)
    if not plan:
        say(f"nothing to restore: every route of merge {last.run_id} is retained >= {cfg.restore_below} or no earlier "
            "checkpoint of the chain scored higher on it")
        return {"restored": {}, "run_id": None}
    registry = TeacherRegistry()
    student = cfg.student_uri or last.merged_uri
    restorers = {}
    for route, r in plan.items():
        name = f"restore-{route}-{r.source[:8]}"
        registry.register_checkpoint(name, route, r.uri, student, eval_score=min(1.0, r.accuracy), replace=True,
                                     provenance=Provenance(source="restore", data=f"chain {','.join(cfg.chain)}"))
        restorers[route] = name
        say(f"route {route}: merge {last.run_id} kept {r.lost:.3f}; its teacher in the next merge is {name} "
            f"({'the base' if r.source == 'base' else 'merge ' + r.source + ' student'}, {r.accuracy:.3f}: {r.uri})")
    teachers = cfg.teachers or next_teachers(last, plan, {n: registry.get(n).route for n in last.teachers}, restorers)
    fields = cfg.model_dump(exclude={"chain", "restore_below"})
    result = merge(MergeConfig.model_validate({**fields, "student_uri": student, "teachers": teachers}))
    client.set_tag(result["run_id"], "chain.runs", ",".join(cfg.chain))
    client.set_tag(result["run_id"], "chain.parent", last.run_id)
    for route, r in plan.items():
        client.set_tag(result["run_id"], f"restore.{route}", f"{restorers[route]} from {r.source} ({r.accuracy:.3f} "
                       f"against {r.lost:.3f})")
    return {**result, "restored": {r: restorers[r] for r in plan}}


def main(argv: list[str] | None = None) -> dict:
    from tasks.cli import parse_config
    from tasks.common.problems import Problem

    def check(cfg: RestoreConfig) -> list[Problem]:
        return [] if cfg.chain else [Problem("--chain", "chain", "expected the MLflow run ids of the chain's merges, "
                                              "oldest first, e.g. --chain '[\"<run id>\"]'")]

    cfg = parse_config(argv, lambda profile="default": RestoreConfig.model_validate(
        pipeline_config(profile).merge("", []).model_dump()), __doc__, with_profile=True, check=check)
    return restore(cfg)


if __name__ == "__main__":
    from tasks.cli import run_main

    sys.exit(run_main(main))
