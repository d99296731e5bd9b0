"""Command line for the teacher registry.

    python -m teachers list
    python -m teachers register --name shift-high-v2 --route shift-high --model_uri ./ckpt [--eval_score 0.97]
                                [--no_mlflow]   # also a version of MLflow model teacher-<route> unless --no_mlflow
    python -m teachers show shift-high-v2
    python -m teachers remove shift-high-v2
    python -m teachers --registry /tmp/reg.json list      # another registry file (default: $OPD_REGISTRY or .opd/)

Flags are spelled as in the flows (``python -m flows.register --model_uri ...``): underscores, the field names.
``register`` checks the checkpoint against the student tokenizer (``--student_tokenizer``, default
``.opd/world/tokenizer`` written by the pipeline) before writing. A refusal prints ``error: ...`` lines to stderr
(the file or field, what was found, what was expected) and exits 2; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tasks.cli import DEBUG, DEBUG_HELP, missing_path_problems, run_main
from tasks.common.paths import world_dir
from tasks.preflight import CONFIG, InputError, Problem
from teachers.registry import GUIDE_DEFAULT_HELP, WRAPPERS, Provenance, TeacherRecord, TeacherRegistry
from tasks.common.table import format_table

COMMAND_LINE = "command line"  # the ``file`` of a problem in this CLI's flags


def build_parser() -> argparse.ArgumentParser:
    debug = argparse.ArgumentParser(add_help=False)  # accepted before or after the command
    debug.add_argument(DEBUG, action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    p = argparse.ArgumentParser(prog="python -m teachers", description="Manage the teacher registry.", parents=[debug])
    p.add_argument("--registry", type=Path, default=None,
                   help="registry file (default: $OPD_REGISTRY or .opd/registry.json)")
    sub = p.add_subparsers(dest="command", required=True)

    reg = sub.add_parser("register", help="check a checkpoint against the student tokenizer and add it",
                         parents=[debug])
    reg.add_argument("--name", required=True, help="unique slug, e.g. shift-high-v2")
    reg.add_argument("--route", required=True, help="route served: a route name of the spec (e.g. rev-high)")
    reg.add_argument("--model_uri", required=True, help="checkpoint folder or hub id (HF config + tokenizer)")
    reg.add_argument("--student_tokenizer", default=None, help="path or hub id (default: <state dir>/world/tokenizer)")
    reg.add_argument("--spec", default="", help="route spec file the route must be one of; on a chat route the "
                     "teacher's chat template is checked against the route's prompt (empty = not checked)")
    reg.add_argument("--base_model", default="", help="for a LoRA adapter folder as --model_uri: the base it applies "
                     "to (local folder or hub id); default: the one its adapter_config.json names")
    reg.add_argument("--eval_score", type=float, default=None, help="accuracy on its route, in [0, 1]")
    reg.add_argument("--replace", action="store_true", help="overwrite a teacher of the same name")
    reg.add_argument("--wrapper", choices=list(WRAPPERS), default="plain",
                     help=TeacherRecord.model_fields["wrapper"].description)
    reg.add_argument("--context_template", default="", help=TeacherRecord.model_fields["context_template"].description)
    reg.add_argument("--guide_fraction", type=float, default=0.0,
                     help=TeacherRecord.model_fields["guide_fraction"].description + GUIDE_DEFAULT_HELP[0])
    reg.add_argument("--guide_steps", type=int, default=0,
                     help=TeacherRecord.model_fields["guide_steps"].description + GUIDE_DEFAULT_HELP[1])
    reg.add_argument("--trust_remote_code", action="store_true", help="allow the checkpoint's own modelling code")
    reg.add_argument("--endpoint", default="", help="vLLM OpenAI-compatible server serving this checkpoint "
                     "(http://host:port); its log-probs are checked against the checkpoint before registering")
    reg.add_argument("--parity_tol", type=float, default=1e-3,
                     help="largest |log p| gap allowed between the endpoint and the checkpoint's fp32 forward "
                     "(a bf16 server needs ~0.05)")
    reg.add_argument("--no_mlflow", action="store_true",
                     help="do not also register it in the MLflow model registry (model teacher-<route>)")

    sub.add_parser("list", help="table of all teachers", parents=[debug])
    show = sub.add_parser("show", help="one teacher as JSON", parents=[debug])
    show.add_argument("name")
    rm = sub.add_parser("remove", help="delete a teacher from the registry (the checkpoint stays)", parents=[debug])
    rm.add_argument("name")
    return p


def student_tokenizer_problems(given: str | None, file: str = CONFIG) -> list[Problem]:
    """No student tokenizer given means the pipeline's (``<state dir>/world/tokenizer``), which must exist then."""
    default = world_dir() / "tokenizer"
    if given or default.exists():
        return []
    return [Problem(file, "student_tokenizer", f"not given, and no student tokenizer at {default}; expected "
                    "--student_tokenizer PATH_OR_ID, or run the pipeline first (python -m flows.pipeline)")]


def _register_input(args: argparse.Namespace) -> str:
    """Refuse what can be told without loading anything (paths that do not exist, no student tokenizer), all at once;
    returns the student tokenizer to check against."""
    problems = missing_path_problems({"model_uri": args.model_uri, "student_tokenizer": args.student_tokenizer},
                                     COMMAND_LINE)
    problems += student_tokenizer_problems(args.student_tokenizer, COMMAND_LINE)
    if problems:
        raise InputError(problems, COMMAND_LINE)
    return args.student_tokenizer or str(world_dir() / "tokenizer")


def _route_messages(args: argparse.Namespace) -> list[dict[str, str]] | None:
    """The chat messages of ``--route`` in ``--spec`` (None without a spec, or for a format route); a route that is
    not in the spec is refused naming its routes."""
    if not args.spec:
        return None
    from tasks.specs.render import route_messages
    from tasks.specs.spec import read_spec

    routes = [r.name for r in read_spec(args.spec).routes]
    if args.route not in routes:
        raise InputError([Problem(COMMAND_LINE, "route", f"{args.route!r} is not a route of {args.spec}; its routes: "
                                  f"{routes}")], COMMAND_LINE)
    return route_messages(args.spec, args.route)


def run(args: argparse.Namespace) -> None:
    registry = TeacherRegistry(args.registry)
    if args.command == "register":
        record = registry.register_checkpoint(
            args.name,
            args.route,
            args.model_uri,
            _register_input(args),
            eval_score=args.eval_score,
            provenance=Provenance(source="cli"),
            replace=args.replace,
            trust_remote_code=args.trust_remote_code,
            endpoint=args.endpoint,
            parity_tol=args.parity_tol,
            wrapper=args.wrapper,
            context_template=args.context_template,
            guide_fraction=args.guide_fraction,
            guide_steps=args.guide_steps,
            messages=_route_messages(args),
            base_model=args.base_model,
        )
        print(f"registered {record.name} (route {record.route}, tokenizer {record.tokenizer_fingerprint}) "
              f"in {registry.path}")
        if not args.no_mlflow:
            from tasks.tracking.runs import publish_teacher, redact, teacher_model_name, tracking_uri

            version = publish_teacher(record)
            print(f"MLflow model {teacher_model_name(record.route)} version {version} (@active) in "
                  f"{redact(tracking_uri())}")
    elif args.command == "list":
        records = registry.list()
        if not records:
            print(f"no teachers in {registry.path}")
            return
        print(format_table(["name", "route", "eval_score", "model_uri"],
                           [[r.name, r.route, r.eval_score, r.model_uri] for r in records]))
    elif args.command == "show":
        print(json.dumps(registry.get(args.name).model_dump(mode="json"), indent=2))
    elif args.command == "remove":
        registry.remove(args.name)
        print(f"removed {args.name} from {registry.path}")


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 2 usage or registry error: ``error: ...`` lines on stderr)."""
    return run_main(lambda a: run(build_parser().parse_args(a)), argv)
