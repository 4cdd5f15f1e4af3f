"""What a resume imports: a fresh process's load imports neither zarr nor numcodecs (zarr's API
took ~0.12 s, nearly torch.load's whole load of 240 MB), from a local directory or an object
store. That zarr's readers still find the codecs: tests/test_format.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import amber_store as amber
from conftest import OBJECT_STORE_PARAMS, store_uri

LOAD = r"""
import json, sys
import amber_store as amber
store = amber.open(sys.argv[1], json.loads(sys.argv[2]), mode="r")
state = store.load(2, lazy=False)
lazy = store.load(1)["w"][:2]
print(json.dumps({"loaded": sorted(state), "heavy": sorted(m for m in sys.modules
                                                         if m.split(".")[0] in ("zarr", "numcodecs"))}))
"""


@pytest.mark.parametrize("kind", ["local", *OBJECT_STORE_PARAMS])
def test_a_fresh_process_loads_full_and_delta_steps_without_importing_zarr(kind, request, tmp_path):
    if kind == "local":
        uri, opts = str(tmp_path / "ckpt"), {}
    else:
        server = request.getfixturevalue(f"{kind}_server")
        uri, opts = store_uri(server), server.storage_options()
    store = amber.open(uri, opts)
    state = {"w": torch.randn(300, 200), "b": torch.randn(7).to(torch.bfloat16), "n": torch.arange(5)}
    store.save(1, state)
    state["w"][:10] += 1
    store.save(2, state)
    out = subprocess.run([sys.executable, "-c", LOAD, uri, json.dumps(opts)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"loaded": ["b", "n", "w"], "heavy": []}
