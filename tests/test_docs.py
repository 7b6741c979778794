"""The documentation site builds with warnings as errors, and every ```python block of its pages runs.

A page's ```python blocks run in order, in one namespace, as a reader would paste them; a ```py block
is shown, not run (it needs a GPU, a cluster or minutes of training). BLOCKS holds how many of each
kind every page has, so adding a page, or turning a block from run to shown, is a change here too.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RUN_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)
SHOWN_BLOCK = re.compile(r"^```py\n(.*?)^```$", re.DOTALL | re.MULTILINE)

# page: (```python blocks, which run; ```py blocks, shown only)
BLOCKS = {
    "index.md": (0, 0),
    "architecture.md": (0, 0),
    "environments.md": (10, 0),
    "rollouts.md": (3, 0),
    "training.md": (2, 1),
    "scaling.md": (0, 0),
    "integrations.md": (1, 0),
    "benchmarks.md": (0, 0),
    "algorithms/index.md": (0, 0),
    "algorithms/rollout.md": (0, 0),
    "algorithms/credit.md": (0, 0),
    "algorithms/losses.md": (0, 0),
    "algorithms/training.md": (0, 0),
    "algorithms/rewards.md": (0, 0),
    "algorithms/steps.md": (0, 0),
    "algorithms/learners.md": (0, 0),
    "contributing.md": (0, 0),
}
# What a page's blocks print, beside the assertions they make themselves.
PRINTS = {
    "environments.md": ("['Chief of Protocol']", "42", "['225']", "apples=2 apples=1"),  # golds, the tool, the MCP fork
    "rollouts.md": (" turns",),
}


def pages() -> list[str]:
    """Every Markdown page of docs/, as a path relative to it (the hooks folder holds no page)."""
    return sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if "hooks" not in p.parts)


def test_every_page_is_counted():
    assert pages() == sorted(BLOCKS)


@pytest.mark.parametrize("page", sorted(BLOCKS))
def test_page_has_its_blocks(page):
    text = (DOCS / page).read_text()
    assert (len(RUN_BLOCK.findall(text)), len(SHOWN_BLOCK.findall(text))) == BLOCKS[page]


def test_site_builds_strict(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's notice about its successor, not ours
    build = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)]
    done = subprocess.run(build, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    # The API reference is generated from the nav's entries: the contract's class and its docstring are there.
    core = (site / "api" / "agentenv.core" / "index.html").read_text()
    assert 'id="agentenv.core.Env"' in core
    assert "fork" in core
    assert ":class:" not in core  # the hook drops the docstrings' Sphinx roles
    # The public surface a user meets first has its pages: the tool env, the run's config, its rollout
    # backend, the evaluation.
    for module, name in (
        ("agentenv.tool_env", "ToolEnv"),
        ("agents.run.config", "TrainConfig"),
        ("agents.run.backends", "RolloutBackend"),
        ("agents.eval.evaluation", "evaluate"),
    ):
        assert f'id="{module}.{name}"' in (site / "api" / module / "index.html").read_text()
    # docs/contributing.md includes CONTRIBUTING.md rather than copying it.
    assert "The layout" in (site / "contributing" / "index.html").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("page", sorted(page for page, (run, _) in BLOCKS.items() if run))
def test_page_python_blocks_run(page, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # blocks name repository files by relative path (the tests' MCP server)
    namespace: dict = {}
    for i, block in enumerate(RUN_BLOCK.findall((DOCS / page).read_text())):
        try:
            exec(compile(block, f"docs/{page} python block {i + 1}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"docs/{page} python block {i + 1} failed: {type(e).__name__}: {e}\n{block}") from e
    out = capsys.readouterr().out
    for printed in PRINTS.get(page, ()):
        assert printed in out
