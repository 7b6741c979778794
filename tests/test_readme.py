"""Every ```python block of the README runs, in order, in one namespace (the tour must not rot)."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```$", README.read_text(), re.DOTALL | re.MULTILINE)


@pytest.mark.slow
def test_readme_python_blocks_run(capsys):
    assert len(BLOCKS) >= 6
    namespace: dict = {}
    for i, block in enumerate(BLOCKS):
        try:
            exec(compile(block, f"README.md python block {i + 1}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"README python block {i + 1} failed: {type(e).__name__}: {e}\n{block}") from e
    assert "42" in capsys.readouterr().out
