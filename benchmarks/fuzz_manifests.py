"""Fuzz the manifests of a real store: every load ends bit-exact or in an amber error.

Each case copies a store (by default the committed format fixture of the current version, whose
steps hold every encoding, packs, shards and a sharded DCP step), mutates one value of one
step's manifest where it says where and how the bytes lie (tensor entries, packs, extra, group,
bases, segment, version), then opens the store and loads that step whole and its info. The
outcome must be a bit-exact load or an :class:`amber_store.AmberError`, within seconds; never
another exception, and never a file opened outside the store (an audit hook watches for a
canary file the mutations point at, and for /etc/passwd). `make test` runs 300 cases
(tests/test_untrusted.py); this script runs more:

    python benchmarks/fuzz_manifests.py [--cases 500] [--seed 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import amber_store as amber  # noqa: E402
from amber_store import format as fmt  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "data" / f"format-v{fmt.FORMAT_VERSION}"
#: the parts of a manifest that say where and how the bytes lie (its tree has no checksum: a
#: changed plain value there is not damage a reader can see)
FIELDS = ("tensors", "packs", "extra", "group", "base", "segment", "depth", "kind", "format_version", "step")
#: a case that takes longer than this has hung, as far as the fuzz is concerned
CASE_SECONDS = 10.0


def values(rng: random.Random, canary: Path) -> list[Any]:
    """What a crafted manifest puts where another value was."""
    return [0, -1, 1, 2**31, 2**63, 10**12, None, True, 1.5, "", "x", [], {}, [0], {"a": 1},
            str(canary), f"steps/../../{canary.parent.name}/{canary.name}", "../" * 6 + "etc/passwd",
            "steps/000000000001-x/%2E%2E", "steps/\x00", rng.randrange(1 << 32)]


def places(obj: Any, path: tuple[Any, ...] = ()) -> Any:
    """Every (path, value) of a JSON value, containers included."""
    yield path, obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from places(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from places(v, (*path, i))


def mutate(d: dict[str, Any], rng: random.Random, canary: Path) -> str:
    """Change one value of manifest ``d`` in place (delete it, nudge a number, or put another
    value there); what was done, in words."""
    spots = [(p, v) for p, v in places(d) if p and p[0] in FIELDS]
    path, value = rng.choice(spots)
    parent = d
    for part in path[:-1]:
        parent = parent[part]
    what = rng.random()
    if what < 0.15 and isinstance(parent, dict):
        del parent[path[-1]]
        return f"deleted {path}"
    if what < 0.3 and isinstance(value, int) and not isinstance(value, bool):
        parent[path[-1]] = value + rng.choice([-1, 1, 7, 1 << 20])
    else:
        parent[path[-1]] = rng.choice(values(rng, canary))
    return f"{path} = {parent[path[-1]]!r}"[:200]


def fuzz(cases: int, seed: int, work: Path, same: Callable[[Any, Any], None],
         fixture: Path = FIXTURE) -> dict[str, int]:
    """Run ``cases`` mutations in ``work``; ``same(a, b)`` raises AssertionError unless two loads
    are bit-equal. Returns the tally of outcomes; raises AssertionError on a case that ends
    otherwise (another exception, a load that is neither, a hang, a file opened outside)."""
    reference = amber.open(fixture, mode="r")
    expected = {s: reference.load(s, lazy=False) for s in reference.steps()}
    canary = work / "canary" / "secret"
    canary.parent.mkdir(parents=True)
    canary.write_bytes(b"\0" * 64)
    opened: list[str] = []
    watching = threading.Event()

    def audit(event: str, args: tuple[Any, ...]) -> None:
        if watching.is_set() and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            name = os.fsdecode(args[0])
            if "canary" in name or name == "/etc/passwd":
                opened.append(name)

    sys.addaudithook(audit)  # (hooks stay for the process: this one records only while watching)
    rng = random.Random(seed)
    tally: dict[str, int] = {}
    root = work / "store"
    for case in range(cases):
        if root.exists():
            shutil.rmtree(root)
        shutil.copytree(fixture, root)
        step = rng.choice(sorted(expected))
        path = root / fmt.commit_key(step)
        d = json.loads(path.read_bytes())
        what = mutate(d, rng, canary)
        path.write_bytes(json.dumps(d).encode())
        t0 = time.perf_counter()
        watching.set()
        try:
            with amber.open(root, mode="r") as store:
                got = store.load(step, lazy=False)
                store.info(step)
            same(got, expected[step])
            outcome = "bit-exact"
        except amber.AmberError as e:
            outcome = type(e).__name__
        except AssertionError:
            raise AssertionError(f"case {case} ({what}): loaded without an error, and not bit-exact") from None
        except BaseException as e:
            raise AssertionError(f"case {case} ({what}): {type(e).__name__}: {e}") from e
        finally:
            watching.clear()
        took = time.perf_counter() - t0
        assert took < CASE_SECONDS, f"case {case} ({what}) took {took:.1f} s"
        assert not opened, f"case {case} ({what}) opened {opened}"
        tally[outcome] = tally.get(outcome, 0) + 1
    return tally


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=500)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from conftest import assert_tree_bit_equal

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        tally = fuzz(args.cases, args.seed, Path(tmp), assert_tree_bit_equal)
    print(f"{args.cases} mutated manifests (seed {args.seed}) in {time.perf_counter() - t0:.0f} s: {tally}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
