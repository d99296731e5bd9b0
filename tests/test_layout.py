"""The layout rule (STYLE habit 14, "benchmarks are not flows"): ``flows/`` lists what a user runs and schedules, and
nothing else; benchmarks (comparison scripts that reuse the flows' tasks) live in ``flows/bench/``.

``flows/`` is read against the README's own list of flows, the ``python -m flows.<name>`` lines under *Running each
flow on its own*: a module directly in ``flows/`` that a user can run (it defines a ``@flow`` or has a ``__main__``
block) must be on that list, so a benchmark put back next to the flows fails here until the README calls it a flow.
"""

import ast
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
FLOWS = ROOT / "flows"
BENCH = FLOWS / "bench"


def readme_flow_list() -> list[str]:
    """The module names of the README's flow list (the first code block under *Running each flow on its own*)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Running each flow on its own\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    names = re.findall(r"^python -m flows\.(\w+)\b", block, flags=re.M)
    assert names, "no `python -m flows.<name>` line under 'Running each flow on its own' in README.md"
    return sorted(set(names))


def runnable(path: Path) -> bool:
    """Whether a module is something a user runs: it defines a Prefect ``@flow`` or has a ``__main__`` block."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for dec in node.decorator_list:
                target = dec.func if isinstance(dec, ast.Call) else dec
                if isinstance(target, ast.Name) and target.id == "flow":
                    return True
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return True
    return False


def modules(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")


def test_flows_holds_only_the_flows_a_user_runs():
    listed = readme_flow_list()
    top = modules(FLOWS)
    benchmarks = [m for m in top if m.startswith("bench")]
    assert benchmarks == [], f"benchmarks directly in flows/: {benchmarks}; they belong in flows/bench/ (STYLE 14)"
    unlisted = [m for m in top if runnable(FLOWS / f"{m}.py") and m not in listed]
    assert unlisted == [], (
        f"{', '.join(f'flows/{m}.py' for m in unlisted)} can be run but is not in the README's flow list ('Running "
        "each flow on its own'): a user flow goes on that list, a benchmark goes in flows/bench/")
    assert [m for m in listed if m not in top] == [], "the README lists a flow that is not a module in flows/"


def test_every_benchmark_is_in_flows_bench_and_runs_as_flows_bench_name():
    readme = (ROOT / "README.md").read_text()
    bench = modules(BENCH)
    assert {"benchmark", "engines", "memory", "step", "teachers", "trl"} <= set(bench), bench
    assert ast.get_docstring(ast.parse((BENCH / "__init__.py").read_text())), "flows/bench/__init__.py: no docstring"
    for name in bench:
        doc = ast.get_docstring(ast.parse((BENCH / f"{name}.py").read_text())) or ""
        assert f"-m flows.bench.{name}" in doc, f"flows/bench/{name}.py: its docstring's Run: line is stale"
        assert f"flows.bench.{name}" in readme, f"README.md never mentions flows.bench.{name}"
        assert name not in readme_flow_list(), f"flows.bench.{name} shadows a flow of the README's list"


def test_deployments_point_at_user_flows_or_benchmarks_by_module_path():
    """A deployment runs a user flow (a file in flows/) or a benchmark (flows/bench/, by module path: for a file
    entrypoint Prefect puts the file's folder first on sys.path, and flows/bench/teachers.py would stand in for the
    ``teachers`` package in the flow-run process)."""
    doc = yaml.safe_load((ROOT / "infra" / "prefect.yaml").read_text())
    listed, bench = readme_flow_list(), modules(BENCH)
    for d in doc["deployments"]:
        target = d["entrypoint"].rsplit(":", 1)[0]
        if target.endswith(".py"):
            assert Path(target).parent == Path("flows") and Path(target).stem in listed, d["entrypoint"]
        else:
            package, _, name = target.rpartition(".")
            assert package == "flows.bench" and name in bench, d["entrypoint"]


# ------------------------------------------------------------------------------------------- the import graph


def project_imports(package: str) -> dict[str, set[str]]:
    """``{"tasks.merging.merge": {"tasks.training.distill", ...}}``: every import of a project module by each module of
    ``package`` (its subpackages included), at module level or deferred inside a function (a deferred import that
    closes a cycle is a cycle still, only one that fails later)."""
    edges: dict[str, set[str]] = {}
    for f in sorted((ROOT / package).rglob("*.py")):
        parts = f.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found = edges.setdefault(name, set())
        for node in ast.walk(ast.parse(f.read_text())):
            targets = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            found |= {t for t in targets if t.split(".")[0] in ("tasks", "teachers") and "." in t}
    return edges


def group_of(module: str) -> str:
    """The concern a module of tasks/ belongs to: its subpackage (``tasks.training``), or itself when it sits
    directly in tasks/ (``tasks.config``, ``tasks.cli``, ``tasks.preflight``)."""
    return ".".join(module.split(".")[:2])


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every module on a cycle, as one path around it per cycle found by a depth-first search."""
    out, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                out.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node)
    return out


def test_the_import_graph_of_tasks_and_teachers_has_no_cycle():
    edges = {**project_imports("tasks"), **project_imports("teachers")}
    assert len(edges) > 40 and "tasks.specs.spec" in edges["tasks.specs.prompt_set"]  # it read the tree
    assert cycles(edges) == []


# The concerns of tasks/, bottom to top: each imports only those before it (tasks.config, tasks.cli and
# tasks.preflight sit directly in tasks/, each its own place in the order).
LAYERS = ["tasks.common", "tasks.objectives", "tasks.specs", "tasks.world", "tasks.gym", "tasks.modeling", "tasks.config",
          "tasks.cli", "tasks.tracking", "tasks.evaluation", "tasks.training", "tasks.merging", "tasks.preflight",
          "tasks.bench"]


def test_the_concerns_of_tasks_import_one_way_bottom_to_top():
    """tasks/ is grouped by concern; a module imports only its own group and the groups below it, deferred imports
    included, so the tree reads as the architecture (LAYERS, bottom first)."""
    edges = project_imports("tasks")
    groups = {group_of(m) for m in edges} - {"tasks"}
    assert groups == set(LAYERS), f"a group not in LAYERS, or one gone: {sorted(groups ^ set(LAYERS))}"
    rank = {g: i for i, g in enumerate(LAYERS)}
    upward = sorted(f"{m} -> {t}" for m, deps in edges.items() if group_of(m) in rank
                    for t in deps if t.startswith("tasks.") and rank.get(group_of(t), -1) > rank[group_of(m)])
    assert upward == [], "imports pointing up the layers: " + "; ".join(upward)


def test_imports_between_the_packages_point_one_way_teachers_to_tasks():
    """``teachers/`` (the registry, the router, their preflight and CLI) is built on ``tasks/``; nothing in ``tasks/``
    imports ``teachers``, deferred imports included: the merge reads teachers through tasks/modeling/routing.py's protocols."""
    up = {m: sorted(t for t in deps if t.startswith("teachers.")) for m, deps in project_imports("tasks").items()}
    assert {m: d for m, d in up.items() if d} == {}
    assert any(t.startswith("tasks.") for t in project_imports("teachers")["teachers.registry"])  # it read imports


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_the_refusals_vocabulary_sits_at_the_bottom_of_the_tree():
    """Specs, prompt sets, the preflight and the CLI all speak tasks/common/problems.py; it imports nothing of theirs."""
    edges = project_imports("tasks")
    assert edges["tasks.common.problems"] == set()
    assert "tasks.common.problems" in edges["tasks.specs.spec"] and "tasks.preflight" not in edges["tasks.specs.spec"]


# ------------------------------------------------------------------------------------- test-only fault injection


def test_no_production_module_knows_of_fault_injection():
    """Fault injection ($OPD_FAULT) is test-only: tests/faults hooks the production functions from outside, so no
    module under tasks/, flows/ or teachers/ calls a fault point, imports a faults module or reads $OPD_FAULT."""
    assert not (ROOT / "tasks" / "faults.py").exists()
    offenders = []
    files = sorted(p for package in ("tasks", "flows", "teachers") for p in (ROOT / package).rglob("*.py"))
    assert len(files) > 50, len(files)  # it read the tree
    for f in files:
        text = f.read_text()
        imports = [name for node in ast.walk(ast.parse(text, str(f))) if isinstance(node, (ast.Import, ast.ImportFrom))
                   for name in [getattr(node, "module", None) or "", *(a.name for a in node.names)]]
        if re.search(r"\bfault\(", text) or "OPD_FAULT" in text or any("fault" in m for m in imports):
            offenders.append(str(f.relative_to(ROOT)))
    assert offenders == [], f"fault injection in production code: {offenders} (it belongs in tests/faults)"
