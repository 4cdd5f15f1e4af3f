"""The README's code runs as pasted."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def block_after(heading: str) -> str:
    """The first ```python block after ``heading``."""
    return re.search(r"```python\n(.*?)```", README[README.index(heading):], re.S).group(1)


@pytest.mark.parametrize("heading", ["## Quickstart", "### In a training loop", "### With Lightning",
                                     "### With Hugging Face"])
def test_readme_example_runs_as_pasted_and_again(heading, tmp_path):
    code = block_after(heading)
    for _ in range(2):  # a second run finds the first's checkpoints (resumes, or starts over with mode="w")
        out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
