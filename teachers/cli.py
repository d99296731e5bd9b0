"""Command line for the teacher registry.

    python -m teachers list
    python -m teachers register --name shift-high-v2 --route shift-high --model-uri ./ckpt [--eval-score 0.97]
                                [--no-mlflow]   # also a version of MLflow model teacher-<route> unless --no-mlflow
    python -m teachers show shift-high-v2
    python -m teachers remove shift-high-v2
    python -m teachers --registry /tmp/reg.json list      # another registry file (default: $OPD_REGISTRY or .opd/)

``register`` checks the checkpoint against the student tokenizer (``--student-tokenizer``, default
``.opd/world/tokenizer`` written by the pipeline) before writing. Errors print one line to stderr and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tasks.paths import world_dir
from teachers.registry import Provenance, RegistryError, TeacherRegistry
from tasks.table import format_table


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m teachers", description="Manage the teacher registry.")
    p.add_argument("--registry", type=Path, default=None,
                   help="registry file (default: $OPD_REGISTRY or .opd/registry.json)")
    sub = p.add_subparsers(dest="command", required=True)

    reg = sub.add_parser("register", help="check a checkpoint against the student tokenizer and add it")
    reg.add_argument("--name", required=True, help="unique slug, e.g. shift-high-v2")
    reg.add_argument("--route", required=True, help="route served, <domain>-<budget>")
    reg.add_argument("--model-uri", required=True, help="checkpoint folder or hub id (HF config + tokenizer)")
    reg.add_argument("--student-tokenizer", default=None, help="path or hub id (default: <state dir>/world/tokenizer)")
    reg.add_argument("--eval-score", type=float, default=None, help="accuracy on its route, in [0, 1]")
    reg.add_argument("--replace", action="store_true", help="overwrite a teacher of the same name")
    reg.add_argument("--trust-remote-code", action="store_true", help="allow the checkpoint's own modelling code")
    reg.add_argument("--endpoint", default="", help="vLLM OpenAI-compatible server serving this checkpoint "
                     "(http://host:port); its log-probs are checked against the checkpoint before registering")
    reg.add_argument("--parity-tol", type=float, default=1e-3,
                     help="largest |log p| gap allowed between the endpoint and the checkpoint's fp32 forward "
                     "(a bf16 server needs ~0.05)")
    reg.add_argument("--no-mlflow", action="store_true",
                     help="do not also register it in the MLflow model registry (model teacher-<route>)")

    sub.add_parser("list", help="table of all teachers")
    show = sub.add_parser("show", help="one teacher as JSON")
    show.add_argument("name")
    rm = sub.add_parser("remove", help="delete a teacher from the registry (the checkpoint stays)")
    rm.add_argument("name")
    return p


def _student_tokenizer(arg: str | None) -> str:
    if arg is not None:
        return arg
    default = world_dir() / "tokenizer"
    if not default.exists():
        raise RegistryError(
            f"no student tokenizer at {default}: pass --student-tokenizer PATH_OR_ID or run the pipeline first"
        )
    return str(default)


def run(args: argparse.Namespace) -> None:
    registry = TeacherRegistry(args.registry)
    if args.command == "register":
        record = registry.register_checkpoint(
            args.name,
            args.route,
            args.model_uri,
            _student_tokenizer(args.student_tokenizer),
            eval_score=args.eval_score,
            provenance=Provenance(source="cli"),
            replace=args.replace,
            trust_remote_code=args.trust_remote_code,
            endpoint=args.endpoint,
            parity_tol=args.parity_tol,
        )
        print(f"registered {record.name} (route {record.route}, tokenizer {record.tokenizer_fingerprint}) "
              f"in {registry.path}")
        if not args.no_mlflow:
            from tasks.tracking import publish_teacher, redact, teacher_model_name, tracking_uri

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
    """Run the CLI; returns the exit code (0 ok, 2 usage or registry error)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse exits on --help and usage errors; callers of main() want the code
        return int(e.code or 0)
    try:
        run(args)
    except (RegistryError, ValueError, OSError) as e:
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"error: {message}", file=sys.stderr)
        return 2
    return 0
