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


def _run_time_imports(body: list[ast.stmt], in_function: bool = False):
    """The import statements that run, each with whether it runs in a function (later) or when the module loads.

    Everything but the blocks under ``if TYPE_CHECKING:``, which never run.
    """
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, in_function
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _run_time_imports(node.orelse, in_function)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _run_time_imports(node.body, True)
        else:
            blocks = [getattr(node, name, []) for name in ("body", "orelse", "finalbody")]
            blocks += [handler.body for handler in getattr(node, "handlers", [])]  # try/except
            blocks += [case.body for case in getattr(node, "cases", [])]  # match
            for block in blocks:
                yield from _run_time_imports([stmt for stmt in block if isinstance(stmt, ast.stmt)], in_function)


def imports_of(name: str, modules: dict[str, Path] = MODULES) -> tuple[set[str], set[str]]:
    """The project modules ``name`` imports when it loads, and those it imports only inside functions
    (``from a import b`` counts ``a.b`` if that is a module; one imported both ways counts as loaded)."""
    tree = ast.parse(modules[name].read_text())
    package = name if modules[name].name == "__init__.py" else name.rpartition(".")[0]
    loaded, deferred = set(), set()
    for node, in_function in _run_time_imports(tree.body):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        (deferred if in_function else loaded).update(target for target in targets if target in modules)
    loaded.discard(name)
    return loaded, deferred - loaded - {name}


def third_party_loaded(name: str, modules: dict[str, Path] = MODULES) -> set[str]:
    """The top-level names of the packages outside the project that ``name`` imports when it loads."""
    found = set()
    for node, in_function in _run_time_imports(ast.parse(modules[name].read_text()).body):
        if in_function or (isinstance(node, ast.ImportFrom) and node.level):
            continue
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        found.update(top for top in (n.split(".")[0] for n in names) if top not in PACKAGES)
    return found


IMPORTS = {name: imports_of(name) for name in MODULES}
THIRD_PARTY = {name: third_party_loaded(name) for name in MODULES}
#: What loads with each module (module-level imports).
LOADS = {name: loaded for name, (loaded, _) in IMPORTS.items()}
#: Every import that runs, at load time or in a function (what an import circle is made of).
GRAPH = {name: loaded | deferred for name, (loaded, deferred) in IMPORTS.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module (Tarjan's algorithm)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
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
                found.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return found


def test_the_graph_sees_the_imports():
    # A walker that found nothing would pass every rule below.
    assert "agents.rollout.tree" in LOADS["agents.rollout.strategies.base"]
    assert "agents.training.losses" in LOADS["agents.training.trainer_config"]
    assert "agents.rollout.tree_loop" not in GRAPH["agents.rollout.strategies.base"]  # only under TYPE_CHECKING
    assert "agents.learners" in GRAPH["agents.run.config"] - LOADS["agents.run.config"]  # in a function
    assert "torch" in third_party_loaded("agents.training.trainer")


def test_no_import_circle_among_the_project_s_modules():
    # Imports inside functions count: a circle closed by one still makes the modules one unit, which no
    # layer can be understood, tested or loaded without.
    assert circles(GRAPH) == [], "modules that import each other in a circle"


def test_the_circle_check_finds_a_circle_closed_inside_a_function(tmp_path):
    package = tmp_path / "planted"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "first.py").write_text("from planted import second\n")
    (package / "second.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from planted import third\n"
        "def later():\n    from planted.first import thing\n"
    )
    (package / "third.py").write_text("import planted.second\n")
    modules = {f"planted.{path.stem}": path for path in package.glob("[!_]*.py")}
    graph = {name: set().union(*imports_of(name, modules)) for name in modules}
    assert circles(graph) == [["planted.first", "planted.second"]]  # third's edge back is TYPE_CHECKING only


#: Packages worth deferring (top-level names; agentenv is the project's own). A function-level import of a
#: project module is deliberate when that module loads one of them and the importing module does not.
DEFERRED = {
    "torch": "heavy: seconds to load",
    "transformers": "heavy: seconds to load",
    "vllm": "optional, and heavy",
    "ray": "optional",
    "wandb": "optional",
    "trl": "optional",
    "peft": "optional",
    "datasets": "optional",
    "aiohttp": "0.4 s, for the openai engine only",
    "tqdm": "0.1 s, for progress bars only (agents.models loads with the CLI's parser)",
    "agentenv": "0.5 s of environments, parsers and datasets, which the parsers and the run config do not need",
}
#: Function-level imports of project modules that defer none of DEFERRED, each with why it waits.
LAZY_IMPORTS: dict[tuple[str, str], str] = {}
#: Scripts whose parts each import what they measure when they run (and vLLM's spawned workers
#: re-import the main module): the circle rule holds for them, the rule on lazy imports does not.
SCRIPTS = ("benchmarks.",)


def lazy_imports(
    imports: dict[str, tuple[set[str], set[str]]], third_party: dict[str, set[str]]
) -> dict[tuple[str, str], set[str]]:
    """Each function-level import of a project module outside :data:`SCRIPTS`, with the DEFERRED packages it
    keeps from loading with the importing module (``imports``: :func:`imports_of` of every module;
    ``third_party``: :func:`third_party_loaded` of every module)."""

    def loaded_with(name: str) -> set[str]:  # name and what loads with it, parent packages included
        seen, todo = set(), [name]
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                parts = module.split(".")
                todo += imports[module][0]
                todo += [p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in imports]
        return seen

    def deferred_packages(name: str) -> set[str]:
        loaded = loaded_with(name)
        packages = {module.split(".")[0] for module in loaded} | {p for m in loaded for p in third_party[m]}
        return packages & DEFERRED.keys()

    packages = {name: deferred_packages(name) for name in imports}
    return {
        (name, target): packages[target] - packages[name]
        for name, (_, deferred) in imports.items()
        if not name.startswith(SCRIPTS)
        for target in deferred
    }


def test_the_lazy_import_check_tells_a_deferred_package_from_none(tmp_path):
    package = tmp_path / "planted"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "light.py").write_text("import json\ndef later():\n    from planted import other, heavy\n")
    (package / "other.py").write_text("import json\n")
    (package / "heavy.py").write_text("import torch\nfrom planted import other\n")
    modules = {"planted": package / "__init__.py"} | {f"planted.{p.stem}": p for p in package.glob("[!_]*.py")}
    imports = {name: imports_of(name, modules) for name in modules}
    third_party = {name: third_party_loaded(name, modules) for name in modules}
    lazy = lazy_imports(imports, third_party)
    assert lazy == {("planted.light", "planted.other"): set(), ("planted.light", "planted.heavy"): {"torch"}}


def test_an_import_inside_a_function_defers_a_heavy_or_optional_package_or_says_why_it_waits():
    lazy = lazy_imports(IMPORTS, THIRD_PARTY)
    unexplained = sorted(pair for pair, packages in lazy.items() if not packages and pair not in LAZY_IMPORTS)
    assert unexplained == [], (
        "imported inside a function though loading it at the top would load none of "
        f"{', '.join(DEFERRED)}: {unexplained}; import these at the top, or list the pair in LAZY_IMPORTS with why"
    )
    stale = sorted(pair for pair in LAZY_IMPORTS if pair not in lazy or lazy[pair])
    assert stale == [], f"LAZY_IMPORTS lists pairs that are no function-level import, or that defer a package: {stale}"


def _reachable(name: str) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        for nxt in GRAPH[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


ABOVE_ROLLOUT = ("agents.training", "agents.learners", "agents.run", "agents.eval", "agents.sft", "agents.cli")


def test_the_agents_package_keeps_its_rooms_and_a_small_lobby():
    # The top level holds what a user imports first; a run's, a score's and a cold start's modules have rooms.
    top = sorted(
        n for n, path in MODULES.items() if n.startswith("agents.") and n.count(".") == 1 and path.name != "__init__.py"
    )
    assert len(top) <= 8, f"agents/ has {len(top)} top-level modules: {top}; give the new ones a sub-package"
    rooms = {"run": "train", "eval": "evaluation", "sft": "demonstrations", "training": "losses"}
    assert all(f"agents.{room}.{member}" in MODULES for room, member in rooms.items())


def test_each_module_of_training_has_a_test_file_of_its_own():
    # The trainer's parts are tested one by one, not only through the trainer: test_<module>.py beside the others.
    tests = ROOT / "tests" / "agents" / "training"
    modules = sorted(
        n.rsplit(".", 1)[1] for n, path in MODULES.items() if n.startswith("agents.training.") and "." not in n[16:]
    )
    assert modules and [m for m in modules if not (tests / f"test_{m}.py").is_file()] == []


def test_the_training_loop_asks_its_backends_rather_than_testing_their_classes():
    # Where a run trains and rolls out is behind two protocols (agents.run.backends); a branch on a concrete
    # class there would make a third backend edit the loop.
    backends = {"Trainer", "TrainerGroup", "LocalRollout", "RolloutPool"}
    tree = ast.parse(MODULES["agents.run.train"].read_text(encoding="utf-8"))
    branches = [
        ast.unparse(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "isinstance"
        and {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} & backends
    ]
    assert branches == [], f"agents/run/train.py branches on a backend's class: {branches}"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n == "agents.rollout" or n.startswith("agents.rollout.")))
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
    loaded = _loaded_after("import agents.learners, agents.run.config")
    assert "agents" in loaded and "torch" in loaded and "transformers" not in loaded
