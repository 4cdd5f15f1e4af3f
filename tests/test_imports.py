"""What a resume imports: a fresh process's load imports neither zarr nor numcodecs (zarr's API
took ~0.12 s, nearly torch.load's whole load of 240 MB), from a local directory or an object
store. That zarr's readers still find the codecs: tests/test_format.py. And how amber_store's
modules import each other: without a circle."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

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


def _imports(path: Path, module: str, package: str, known: set[str]) -> set[str]:
    """The amber_store modules ``module`` imports, at its top or inside a function (a lazy import
    is still an edge), leaving out imports for type checkers only."""
    tree = ast.parse(path.read_text())
    hidden = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
              for n in ast.walk(node)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in hidden or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            target = ".".join(p for p in (base, node.module) if p)
            names = [target] + [f"{target}.{a.name}" for a in node.names]
        found.update(n for n in names if n in known and n != module)
    return found


def test_no_amber_store_module_imports_one_that_imports_it_back():
    # A package's __init__ re-exports its modules by design; the modules themselves import
    # downwards only (docs/ARCHITECTURE.md), lazily or not.
    root = Path(amber.__file__).parent
    paths = {".".join(p.relative_to(root.parent).with_suffix("").parts): p for p in root.rglob("*.py")}
    modules = {m: p for m, p in paths.items() if p.name != "__init__.py"}
    known = set(modules) | {m.removesuffix(".__init__") for m in paths}
    graph = {m: _imports(p, m, m.rpartition(".")[0], known) & set(modules) for m, p in modules.items()}
    done: set[str] = set()

    def circle_from(m: str, path: list[str]) -> list[str] | None:
        if m in path:
            return path[path.index(m):] + [m]
        if m in done:
            return None
        for n in sorted(graph[m]):
            if found := circle_from(n, path + [m]):
                return found
        done.add(m)
        return None

    assert len(graph) > 40 and graph["amber_store.store"]  # the walk found the modules and their imports
    for m in sorted(graph):
        circle = circle_from(m, [])
        assert circle is None, "import circle: " + " -> ".join(circle)
