"""Fuzz the manifests of a real store: every load ends bit-exact or in an amber error.

Each case copies a store (by default the committed format fixture of the current version, whose
steps hold every encoding, packs, shards and a sharded DCP step), mutates one value of one
step's manifest where it says where and how the bytes lie (tensor entries, packs, extra, group,
bases, segment, version, a sharded step's fragments), or, in a sharded step, one value of one
of its fragments (header or columns; the index's record of its checksum then made to match),
then opens the store and loads that step whole and its info. The
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
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import crc32c
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import amber_store as amber  # noqa: E402
from amber_store import format as fmt  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "data" / f"format-v{fmt.FORMAT_VERSION}"
#: the parts of a manifest that say where and how the bytes lie (its tree has no checksum: a
#: changed plain value there is not damage a reader can see)
FIELDS = ("tensors", "packs", "extra", "group", "base", "segment", "depth", "kind", "format_version", "step",
          "fragments")
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
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


def mutate(d: dict[str, Any], rng: random.Random, canary: Path, fields: tuple[str, ...] = FIELDS) -> str:
    """Change one value of manifest ``d`` in place (delete it, nudge a number, or put another
    value there) below one of ``fields``; what was done, in words."""
    spots = [(p, v) for p, v in places(d) if p and p[0] in fields]
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


def mutate_fragment(root: Path, d: dict[str, Any], rng: random.Random, canary: Path) -> str:
    """Change one fragment of the sharded step of index ``d``: a value of its header, or a byte of
    its columns; then give the index the fragment's new checksum and length, so that the change
    reaches the fragment's reader. What was done, in words."""
    i = rng.choice([i for i, f in enumerate(d["fragments"]) if f])
    record = d["fragments"][i]
    path = root / record["key"]
    raw = zstandard.ZstdDecompressor().stream_reader(path.read_bytes()).read()
    (hlen,) = struct.unpack_from("<I", raw, 4)
    if rng.random() < 0.5:
        header = json.loads(raw[8: 8 + hlen])
        what = mutate(header, rng, canary, fields=tuple(header))
        text = json.dumps(header).encode()
        raw = raw[:4] + struct.pack("<I", len(text)) + text + raw[8 + hlen:]
    else:
        at = rng.randrange(8 + hlen, len(raw))
        raw = raw[:at] + bytes([raw[at] ^ (1 << rng.randrange(8))]) + raw[at + 1:]
        what = f"bit flipped at byte {at - 8 - hlen} of the columns"
    data = zstandard.ZstdCompressor().compress(raw)
    path.write_bytes(data)
    record.update(crc32c=crc32c.crc32c(data), nbytes=len(data))
    return f"fragment {i}: {what}"


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
        raw = path.read_bytes()
        compressed = raw[:4] == ZSTD_MAGIC  # (a sharded step's index)
        d = json.loads(zstandard.ZstdDecompressor().stream_reader(raw).read() if compressed else raw)
        if d.get("fragments") and rng.random() < 0.5:
            what = mutate_fragment(root, d, rng, canary)
        else:
            what = mutate(d, rng, canary)
        text = json.dumps(d).encode()
        path.write_bytes(zstandard.ZstdCompressor().compress(text) if compressed else text)
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
