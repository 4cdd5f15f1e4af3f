"""Save and load throughput: amber-store on a local directory and on a real S3 server
(SeaweedFS, started here) through each of its S3 clients (obstore, the default, and s3fs), vs
torch.save to a local file and to the same S3 server.

The same state dict (float32 tensors shaped like a transformer's weights and Adam moments) is
saved full, then as a delta after a small update to every element, then the delta step is
loaded back. Each repeat runs every method once, in rotating order (this machine is shared and
noisy), and each figure is the median (and range) over repeats. MB/s counts raw tensor bytes
(what the training job hands over), not stored bytes.

    python benchmarks/throughput.py --mb 256 --repeats 3
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import amber_store as amber  # noqa: E402
from backends.s3servers import SeaweedFS  # noqa: E402
from benchmarks.common import clock, machine, median_rate, rate, table  # noqa: E402


def make_state(total_mb: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    width = 1024
    state = {}
    for i in range(max(1, total_mb * (1 << 20) // (4 * width * width * 3))):
        state[f"layer{i}.weight"] = torch.randn(width, width, generator=g) * 0.02
        state[f"layer{i}.exp_avg"] = torch.randn(width, width, generator=g) * 1e-3
        state[f"layer{i}.exp_avg_sq"] = torch.rand(width, width, generator=g) * 1e-6
        state[f"layer{i}.bias"] = torch.zeros(width)
    return state


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def amber_run(uri: Callable[[], str], opts: dict | None, state: dict, updated: dict) -> dict[str, Any]:
    """One full save, one delta save, one load of each step, into a fresh store."""
    where = uri()
    with amber.open(where, opts, mode="w") as store:
        full, full_info = clock(lambda: store.save(1, state))
        delta, delta_info = clock(lambda: store.save(2, updated))
    with amber.open(where, opts, mode="r") as reader:
        load_full = clock(lambda: reader.load(1, lazy=False))[0]
        load = clock(lambda: reader.load(2, lazy=False))[0]
    return {"full": full, "delta": delta, "load_full": load_full, "load": load, "full_ratio": full_info.ratio,
            "delta_ratio": delta_info.ratio}


def torch_file_run(path: Path, state: dict) -> dict[str, Any]:
    save = clock(lambda: torch.save(state, path))[0]
    load = clock(lambda: torch.load(path))[0]
    return {"full": save, "delta": save, "load_full": load, "load": load, "full_ratio": 1.0, "delta_ratio": 1.0}


def torch_s3_run(server: SeaweedFS, state: dict) -> dict[str, Any]:
    """torch.save into memory and one PUT; one GET and torch.load (what a job does without
    amber-store)."""
    client, key = server.client(), f"torch/{uuid.uuid4().hex}.pt"

    def save() -> None:
        buf = io.BytesIO()
        torch.save(state, buf)
        client.put_object(Bucket="bench", Key=key, Body=buf.getvalue())

    def load() -> Any:
        return torch.load(io.BytesIO(client.get_object(Bucket="bench", Key=key)["Body"].read()))

    t_save = clock(save)[0]
    t_load = clock(load)[0]
    client.delete_object(Bucket="bench", Key=key)
    return {"full": t_save, "delta": t_save, "load_full": t_load, "load": t_load, "full_ratio": 1.0,
            "delta_ratio": 1.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=128, help="approximate state size in MB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, help="also write the raw figures here")
    args = p.parse_args()
    state = make_state(args.mb)
    g = torch.Generator().manual_seed(1)
    updated = {k: v + 1e-3 * v.abs().mean() * torch.randn(v.shape, generator=g) for k, v in state.items()}
    mb = nbytes(state) / 1e6
    tmp = Path(tempfile.mkdtemp(prefix="amber-bench-"))
    names = ["torch.save, local file", "amber, local directory", "torch.save, SeaweedFS S3", "amber, SeaweedFS S3",
             "amber, SeaweedFS S3 via s3fs"]
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    try:
        with SeaweedFS() as s3:
            s3.create_bucket("bench")
            methods = {
                names[0]: lambda: torch_file_run(tmp / "state.pt", state),
                names[1]: lambda: amber_run(lambda: str(tmp / f"local-{uuid.uuid4().hex}"), None, state, updated),
                names[2]: lambda: torch_s3_run(s3, state),
                names[3]: lambda: amber_run(lambda: f"s3://bench/{uuid.uuid4().hex}", s3.storage_options(), state,
                                            updated),
                names[4]: lambda: amber_run(lambda: f"s3://bench/{uuid.uuid4().hex}",
                                            {**s3.storage_options(), "client": "s3fs"}, state, updated),
            }
            for r in range(args.repeats):
                for name in names[r % len(names):] + names[: r % len(names)]:
                    runs[name].append(methods[name]())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results = {n: {k: [run[k] for run in rs] for k in rs[0]} for n, rs in runs.items()}

    print(f"machine: {machine()}")
    print(f"state: {mb:.0f} MB float32 in {len(state)} tensors; {args.repeats} interleaved runs, "
          "MB/s median (range); SeaweedFS on this machine's loopback\n")
    print(table(["method", "full save MB/s", "delta save MB/s", "load full step MB/s", "load delta step MB/s",
                 "full size ratio", "delta size ratio"],
                [[name, rate(mb, r["full"]), rate(mb, r["delta"]), rate(mb, r["load_full"]), rate(mb, r["load"]),
                  f"{r['full_ratio'][0]:.2f}x", f"{r['delta_ratio'][0]:.2f}x"] for name, r in results.items()]))
    ts, local, ts3, s3r, s3fs = (results[n] for n in names)
    print()
    for what in ("full", "delta", "load_full", "load"):
        print(f"{what:>9}: amber S3 / amber local = {median_rate(mb, s3r[what]) / median_rate(mb, local[what]):.2f}; "
              f"amber S3 / torch.save S3 = {median_rate(mb, s3r[what]) / median_rate(mb, ts3[what]):.2f}; "
              f"obstore / s3fs = {median_rate(mb, s3r[what]) / median_rate(mb, s3fs[what]):.2f}; "
              f"amber local / torch.save local = {median_rate(mb, local[what]) / median_rate(mb, ts[what]):.2f} "
              "(throughput ratios: above 1 is faster)")
    if args.json:
        args.json.write_text(json.dumps({"mb": mb, "results": results}, indent=1))


if __name__ == "__main__":
    main()
