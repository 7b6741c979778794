"""Every ```python block of the README runs, in order, in one namespace (the front page must not rot).

The README keeps one example, an episode and a fork of it; the pages of docs/ hold the rest, and
tests/test_docs.py runs theirs.
"""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```$", README.read_text(), re.DOTALL | re.MULTILINE)


@pytest.mark.slow
def test_readme_python_blocks_run(capsys):
    assert len(BLOCKS) == 1
    namespace: dict = {}
    for i, block in enumerate(BLOCKS):
        try:
            exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"README python block {i + 1} failed: {type(e).__name__}: {e}\n{block}") from e
    out = capsys.readouterr().out
    assert "['Chief of Protocol']" in out  # the question's gold answer, which the fork's parent then gives
    assert "Kiss and Tell (1945 film)" in out  # the search's first passage
