"""What a resume imports: a fresh process's load of a local store imports neither zarr nor
numcodecs (zarr's API took ~0.12 s, nearly torch.load's whole load of 240 MB). That
zarr's readers still find the codecs: tests/test_format.py."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

import amber_store as amber

LOAD = r"""
import json, sys
import amber_store as amber
store = amber.open(sys.argv[1], mode="r")
state = store.load(2, lazy=False)
lazy = store.load(1)["w"][:2]
print(json.dumps({"loaded": sorted(state), "heavy": sorted(m for m in sys.modules
                                                         if m.split(".")[0] in ("zarr", "numcodecs"))}))
"""


def test_a_fresh_process_loads_full_and_delta_steps_without_importing_zarr(tmp_path):
    store = amber.open(tmp_path / "ckpt")
    state = {"w": torch.randn(300, 200), "b": torch.randn(7).to(torch.bfloat16), "n": torch.arange(5)}
    store.save(1, state)
    state["w"][:10] += 1
    store.save(2, state)
    out = subprocess.run([sys.executable, "-c", LOAD, str(tmp_path / "ckpt")], capture_output=True, text=True,
                         check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"loaded": ["b", "n", "w"], "heavy": []}

