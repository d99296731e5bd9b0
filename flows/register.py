"""Flow `register-teacher`: add a specialist checkpoint (local path or hub id) to the teacher registry, after checking
that it loads and shares the student's tokenizer (or, ``--wrapper aligned``, that a model of another family can read
the student's text in its own tokenizer and template), and as a version of MLflow model `teacher-<route>`. The same
validation as `python -m teachers register`; nothing is written when a check fails.

Run:  python -m flows.register --name rev-high-v2 --route rev-high --model_uri ./ckpt [--eval_score 0.97]
"""

from __future__ import annotations

import sys
from typing import Optional

from prefect import flow
from pydantic import Field, field_validator, model_validator

from tasks.config import SpecInput, _Config
from tasks.common.log import say
from tasks.common.paths import world_dir
from tasks.tracking.runs import publish_teacher, teacher_model_name
from tasks.specs.render import route_messages
from tasks.specs.spec import check_route_name
from teachers.registry import GUIDE_DEFAULT_HELP, Provenance, TeacherRecord, TeacherRegistry, Wrapper


class RegisterConfig(_Config):
    """One teacher to register."""

    name: str = Field(..., pattern=r"^[a-z0-9][a-z0-9_.-]*$", description="Unique teacher name, e.g. rev-high-v2.")
    route: str = Field(..., description="Route it serves: a route name of the merge's spec (e.g. rev-high).")
    spec: SpecInput = Field("", description="Route spec whose routes the route must be one of: a file's path, or the "
                            "spec inline (an object, validated as a file is); empty = not checked against a spec.")
    model_uri: str = Field(..., min_length=1, description="Checkpoint folder or hub id (HF config, weights, tokenizer).")
    student_tokenizer: str = Field("", description="Tokenizer the student uses; empty = the built-in world's.")
    eval_score: Optional[float] = Field(None, ge=0, le=1, description="Its accuracy on its route, if known.")
    replace: bool = Field(False, description="Overwrite a teacher of the same name.")
    trust_remote_code: bool = Field(False, description="Allow the checkpoint's own modelling code (off by default).")
    endpoint: str = Field("", description="vLLM OpenAI-compatible server serving it (http://host:port); checked "
                          "against the checkpoint's log-probs before registering.")
    base_model: str = Field("", description="For a LoRA adapter folder as model_uri: the base it applies to (local "
                            "folder or hub id); empty = the one its adapter_config.json names. Checked at every load.")
    mlflow: bool = Field(True, description="Also register it in the MLflow model registry (model teacher-ROUTE).")
    wrapper: Wrapper = Field("plain", description=TeacherRecord.model_fields["wrapper"].description + ".")
    context_template: str = Field("", description=TeacherRecord.model_fields["context_template"].description + ".")
    guide_fraction: float = Field(0.0, ge=0, le=1, description=TeacherRecord.model_fields["guide_fraction"].description
                                  + GUIDE_DEFAULT_HELP[0] + ".")
    guide_steps: int = Field(0, ge=0, le=1_000_000, description=TeacherRecord.model_fields["guide_steps"].description
                             + GUIDE_DEFAULT_HELP[1] + ".")

    @field_validator("route")
    @classmethod
    def _route(cls, v: str) -> str:
        return check_route_name(v)

    @model_validator(mode="after")
    def _in_spec(self) -> "RegisterConfig":
        if self.spec:
            from tasks.specs.spec import read_spec, spec_label

            routes = [r.name for r in read_spec(self.spec).routes]  # InputError names the file (or inline spec), field
            if self.route not in routes:
                raise ValueError(f"route {self.route!r} is not a route of {spec_label(self.spec)}; its routes: {routes}")
        return self


@flow(name="register-teacher", flow_run_name="register-teacher-{cfg.name}")
def register_teacher(cfg: RegisterConfig) -> dict:
    """Validate, then write the registry entry (and the MLflow model version)."""
    record = TeacherRegistry().register_checkpoint(
        cfg.name, cfg.route, cfg.model_uri, cfg.student_tokenizer or str(world_dir() / "tokenizer"),
        eval_score=cfg.eval_score, provenance=Provenance(source="register-teacher"), replace=cfg.replace,
        trust_remote_code=cfg.trust_remote_code, endpoint=cfg.endpoint, wrapper=cfg.wrapper,
        context_template=cfg.context_template, guide_fraction=cfg.guide_fraction, guide_steps=cfg.guide_steps,
        messages=route_messages(cfg.spec, cfg.route) if cfg.spec else None, base_model=cfg.base_model,
    )
    out = {"name": record.name, "route": record.route, "model_uri": record.model_uri}
    say(f"registered teacher {record.name} for route {record.route} ({record.model_uri})")
    if cfg.mlflow:
        out["mlflow_version"] = publish_teacher(record)
        say(f"MLflow model {teacher_model_name(record.route)} version {out['mlflow_version']} (@active)")
    return out


def main(argv: list[str] | None = None) -> dict:
    from tasks.cli import parse_config
    from teachers.cli import student_tokenizer_problems

    # The required fields start empty, so a missing flag fails validation naming it. Refused before Prefect starts.
    cfg = parse_config(argv, lambda: RegisterConfig.model_construct(name="", route="", model_uri=""), __doc__,
                       check=lambda c: student_tokenizer_problems(c.student_tokenizer))
    return register_teacher(cfg)


if __name__ == "__main__":
    from tasks.cli import run_main

    sys.exit(run_main(main))
