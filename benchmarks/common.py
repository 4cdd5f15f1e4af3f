"""Helpers shared by the benchmark scripts: timing with medians and spread, sizes, tables."""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Any, Callable, TypeVar

import torch


def clock(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call."""
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def rate(mb: float, seconds: list[float]) -> str:
    """Throughput as "median (slowest-fastest)" MB/s over repeated runs."""
    rates = sorted(mb / s for s in seconds)
    return f"{statistics.median(rates):.0f} ({rates[0]:.0f}-{rates[-1]:.0f})"


def median_rate(mb: float, seconds: list[float]) -> float:
    return statistics.median(mb / s for s in seconds)


T = TypeVar("T")


def rotated(items: list[T], round_: int) -> list[T]:
    """``items`` in the order of round ``round_`` of an interleaved benchmark: each round starts
    one further along, so no case always runs first (or right after the same one)."""
    k = round_ % len(items)
    return items[k:] + items[:k]


#: the suffix of a case run by another checkout's amber_store (a benchmark's ``--before``)
BEFORE = " (before)"


def fresh_process(code: str, *args: Any, before: Any = None, env: dict[str, str] | None = None,
                  cwd: Any = None) -> Any:
    """Run ``code`` with ``args`` in a fresh Python (``before``: with that checkout's amber_store
    first on the path; ``env``: variables beside this process's); its stdout, parsed as JSON."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, **(env or {})}
    if before is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(before), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env,
                          cwd=cwd)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout)


def spread(xs: list[float], fmt: str = ".3f") -> str:
    """``median (min-max)`` of ``xs``."""
    import statistics

    return f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}}-{max(xs):{fmt}})"


def compiled(*checkouts: Any) -> None:
    """Byte-compile the amber_store package of each checkout (a directory) that the benchmark's
    fresh processes import, as pip does at install: where PYTHONDONTWRITEBYTECODE is set (these
    machines set it) every fresh process would otherwise compile amber-store's modules from
    source (~0.08 s, measured), while torch's came compiled."""
    import compileall
    from pathlib import Path

    for checkout in checkouts:
        compileall.compile_dir(str(Path(checkout) / "amber_store"), quiet=1)


def machine() -> str:
    """The machine and the decode path its loads took (which the CPU's flags decide)."""
    import os

    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}, torch {torch.__version__}, {platform.system()}, {decoder()}")


def decoder() -> str:
    """The native decoder's path (``AMBER_DECODE_PATH`` may force one) and the CPU flags that
    choose it."""
    from amber_store.codecs.compression import decode_path

    flags = cpu_flags()
    shown = [f for f in ("avx2", "avx512f", "avx512bw", "avx512vbmi", "gfni", "asimd", "sve") if f in flags]
    return f"decode path {decode_path()} (CPU flags: {' '.join(shown) or 'none of note'})"


def cpu_flags() -> set[str]:
    """The first CPU's feature flags as Linux lists them (x86 ``flags``, ARM ``Features``; empty
    elsewhere)."""
    from pathlib import Path

    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    return set(next((line.split(":", 1)[1].split() for line in lines if line.startswith(("flags", "Features"))), []))


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A GitHub-flavoured markdown table."""
    cells = [[str(c) for c in r] for r in rows]
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in cells]
    return "\n".join(out)


def training_run_args(p: argparse.ArgumentParser) -> None:
    """The arguments of a benchmark that trains amber_store.demo's TinyGPT and resumes it."""
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--resume-steps", type=int, default=200)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)


def eval_loss(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean cross-entropy of ``model`` over held-out ``batches``."""
    with torch.no_grad():
        losses = []
        for x, y in batches:
            logits = model(x)
            losses.append(float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))))
    return statistics.mean(losses)


def distant_args(p: argparse.ArgumentParser, trials: int) -> None:
    """The options of :func:`distant_trials`."""
    from pathlib import Path

    p.add_argument("--trials", type=int, default=trials)
    p.add_argument("--latency", type=float, default=0.02, help="seconds each request is held back")
    p.add_argument("--before", type=Path, help="a checkout whose amber_store runs the same trials too")
    p.add_argument("--json", type=Path, help="also write the raw figures here")


def distant_trials(args: argparse.Namespace, bucket: str,
                   trial: Callable[[str, str, Any], dict]) -> tuple[list[str], dict[str, list[dict]]]:
    """``trial(uri, options as JSON, before)`` ``--trials`` times for each case (this checkout's
    amber_store, and ``--before``'s: ``before`` is then that checkout), interleaved, each on a
    fresh location in ``bucket`` of a SeaweedFS on loopback behind a proxy that holds each
    request back ``--latency`` seconds (a distant store's round trip); the cases and each one's
    results, also written to ``--json``."""
    import json
    import uuid
    from pathlib import Path

    from backends.faultproxy import FaultProxy
    from backends.s3servers import SeaweedFS

    cases = ["amber"] + ([f"amber{BEFORE}"] if args.before else [])
    compiled(Path(__file__).resolve().parents[1], *([args.before] if args.before else []))
    got: dict[str, list[dict]] = {k: [] for k in cases}
    with SeaweedFS() as server, FaultProxy(server.endpoint, delay=args.latency) as proxy:
        server.create_bucket(bucket)
        opts = json.dumps({**server.storage_options(), "endpoint_url": proxy.endpoint})
        for r in range(args.trials):
            for kind in rotated(cases, r):
                got[kind].append(trial(f"s3://{bucket}/{uuid.uuid4().hex}", opts,
                                       args.before if kind.endswith(BEFORE) else None))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                                         "results": got}, indent=1))
    return cases, got
