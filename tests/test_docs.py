"""The README's code runs as pasted."""

from __future__ import annotations

import re
import signal
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
def test_readme_example_runs_as_pasted_and_again_without_a_warning(heading, tmp_path):
    code = block_after(heading)
    for run in range(2):  # a second run finds the first's checkpoints (resumes, or starts over with mode="w")
        # amber-store's warnings are RuntimeWarnings (others' are theirs: Lightning's tips, say); a
        # first run of the training loop is told it starts fresh, and nothing else
        fresh = ["-W", "always:no checkpoint at:RuntimeWarning"] if run == 0 else []
        out = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", *fresh, "-c", code],
                             cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        if heading == "### In a training loop":
            assert ("starting fresh" if run == 0 else "resumed at step 100") in out.stdout, out.stdout


def test_readme_starts_a_local_s3_server_whose_printed_open_line_opens_a_store(tmp_path):
    command = re.search(r"To try S3 without an account.*?```\n(.*?)\n```", README, re.S).group(1).split()
    assert command[0] == ".venv/bin/python"
    server = subprocess.Popen([sys.executable, *command[1:], "--data-dir", str(tmp_path / "data")],
                              cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE, text=True)
    try:
        lines = [server.stdout.readline() for _ in range(2)]
        open_line = lines[1].strip()
        assert open_line.startswith("amber.open('s3://amber/run', "), lines
        code = (f"import torch, amber_store as amber\nstore = {open_line}\n"
                "store.save(1, {'w': torch.ones(3)})\nassert store.load(1, lazy=False)['w'].sum() == 3\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(30)
