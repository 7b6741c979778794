"""The layout's rules, checked on the code: light rollout side, no import circles, layers that import downwards."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("agentenv", "agents", "sandboxes", "benchmarks")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _run_time_imports(body: list[ast.stmt]):
    """Import statements run when the module loads: module level, not under TYPE_CHECKING or in a function."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and not _is_type_checking(node.test):
            yield from _run_time_imports(node.body)
            yield from _run_time_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _run_time_imports(block)


def imports_of(name: str) -> set[str]:
    """The project modules ``name`` imports when it loads (``from a import b`` counts ``a.b`` if that is a module)."""
    tree = ast.parse(MODULES[name].read_text())
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _run_time_imports(tree.body):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        found.update(target for target in targets if target in MODULES)
    found.discard(name)
    return found


GRAPH = {name: imports_of(name) for name in MODULES}


def test_the_graph_sees_the_imports():
    # A walker that found nothing would pass every rule below.
    assert "agents.rollout.tree" in GRAPH["agents.rollout.strategies.base"]
    assert "agents.training.losses" in GRAPH["agents.training.trainer_config"]
    assert "agents.rollout.tree_loop" not in GRAPH["agents.rollout.strategies.base"]  # only under TYPE_CHECKING before


def test_no_import_circle_among_the_project_s_modules():
    index, low, on_stack, stack, circles = {}, {}, set(), [], []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(GRAPH[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for name in sorted(GRAPH):
        if name not in index:
            visit(name)
    assert circles == [], f"modules that import each other in a circle: {circles}"


def _reachable(name: str) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        for nxt in GRAPH[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


ABOVE_ROLLOUT = (
    "agents.training",
    "agents.learners",
    "agents.config",
    "agents.train",
    "agents.cli",
    "agents.evaluation",
    "agents.heldout",
)


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("agents.rollout")))
def test_the_rollout_side_imports_nothing_above_it(name):
    above = sorted(m for m in _reachable(name) if m.startswith(ABOVE_ROLLOUT))
    assert above == [], f"{name} imports {above}, which belong above the rollout side"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("agents.rollout.strategies.")))
def test_a_strategy_depends_on_its_contract_not_on_the_loop_that_runs_it(name):
    loop_side = {"agents.rollout.tree_loop", "agents.rollout.diagnostics"}
    assert not (_reachable(name) & loop_side), f"{name} imports {sorted(_reachable(name) & loop_side)}"


def test_engines_import_nothing_of_the_rollout_or_training_sides():
    for name in (n for n in MODULES if n.startswith("agents.engines")):
        upper = sorted(m for m in _reachable(name) if m.startswith(("agents.rollout", *ABOVE_ROLLOUT)))
        assert upper == [], f"{name} imports {upper}"


def _loaded_after(statement: str) -> set[str]:
    probe = f"import sys\n{statement}\nprint(' '.join(sorted(m.split('.')[0] for m in sys.modules)))"
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(result.stdout.split())


def test_credit_strategies_and_the_rollout_side_load_without_torch():
    loaded = _loaded_after(
        "import agents.training.credit, agents.rollout.strategies, agents.rollout, agents.rollout.tree, "
        "agents.rollout.diagnostics, agents.rollout.tree_loop"
    )
    assert "agents" in loaded and "torch" not in loaded and "transformers" not in loaded


def test_learners_and_the_run_config_load_without_transformers():
    loaded = _loaded_after("import agents.learners, agents.config")
    assert "agents" in loaded and "torch" in loaded and "transformers" not in loaded
