"""Save and load throughput: amber-store on a local directory, on a real S3 server (SeaweedFS,
started here) through each of its S3 clients (obstore, the default, and s3fs) and on Azurite (the
Azure Blob emulator, started here where ``make test`` installed it) through each of its Azure
clients (obstore, the default, and adlfs), vs torch.save to a local file and to the same servers
(one PUT with botocore; one upload with Azure's SDK), and vs AWS's s3torchconnector
(``S3Checkpoint``, and its DCP ``S3StorageWriter`` / ``S3StorageReader``) when installed.

The same state dict (float32 tensors shaped like a transformer's weights and Adam moments) is
saved full, then as a delta after a small update to every element, then each step is loaded
back. Each repeat runs every method once, in rotating order (this machine is shared and noisy),
and each figure is the median (and range) over repeats. MB/s counts raw tensor bytes (what the
training job hands over), not stored bytes. Every S3 method's steps are also loaded the way a
resume loads them, each in a fresh process (imports and building the target state excluded),
and the CPU seconds the client process and the server spend per GB loaded are reported.

    python benchmarks/throughput.py --mb 256 --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import amber_store as amber  # noqa: E402
from backends.s3servers import SeaweedFS  # noqa: E402
from benchmarks.common import compiled, machine, median_rate, rate, rotated, table  # noqa: E402

REGION = "us-east-1"
warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # (DCP in one process)


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


def server_cpu(pid: int | None) -> float:
    """CPU seconds (user + system) the process ``pid`` has used so far."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Clock:
    """Times calls: wall seconds, this process's CPU seconds (every thread) and the server's."""

    def __init__(self, server_pid: int | None) -> None:
        self.server_pid = server_pid

    def __call__(self, fn: Callable[[], Any]) -> tuple[dict[str, float], Any]:
        c0, s0, t0 = time.process_time(), server_cpu(self.server_pid), time.perf_counter()
        result = fn()
        t1 = time.perf_counter()
        return {"s": t1 - t0, "cpu": time.process_time() - c0, "server_cpu": server_cpu(self.server_pid) - s0}, result


# The methods: each saves steps 1 (full) and 2 (the update) where its ``spec`` (JSON) says, and
# loads them back, also in a fresh process (CHILD).

@contextmanager
def saver(save: Callable[[dict, int, dict], Any], spec: dict) -> Iterator[Callable[[int, dict], Any]]:
    yield lambda step, state: save(spec, step, state)


@contextmanager
def amber_saver(spec: dict) -> Iterator[Callable[[int, dict], Any]]:
    """One open store for a run's saves, as a training job keeps it (deltas diff against the
    values it holds)."""
    with amber.open(spec["uri"], spec["options"], mode="w") as store:
        yield store.save


def amber_load(spec: dict, step: int, like: dict | None = None) -> Any:
    with amber.open(spec["uri"], spec["options"], mode="r") as store:
        return store.load(step, lazy=False)


def torch_file_save(spec: dict, step: int, state: dict) -> None:
    torch.save(state, f"{spec['path']}.{step}")


def torch_file_load(spec: dict, step: int, like: dict | None = None) -> Any:
    return torch.load(f"{spec['path']}.{step}")


def botocore_client(spec: dict) -> Any:
    """What boto3.client("s3") makes (boto3 is botocore's thin wrapper, not installed here)."""
    import botocore.config
    import botocore.session

    return botocore.session.get_session().create_client(
        "s3", endpoint_url=spec["endpoint"], aws_access_key_id=spec["key"], aws_secret_access_key=spec["secret"],
        region_name=REGION, config=botocore.config.Config(s3={"addressing_style": "path"}))


def torch_s3_save(spec: dict, step: int, state: dict) -> None:
    """torch.save into memory and one PUT (what a job does without a checkpoint library)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    botocore_client(spec).put_object(Bucket=spec["bucket"], Key=f"{spec['prefix']}/{step}.pt", Body=buf.getvalue())


def torch_s3_load(spec: dict, step: int, like: dict | None = None) -> Any:
    body = botocore_client(spec).get_object(Bucket=spec["bucket"], Key=f"{spec['prefix']}/{step}.pt")["Body"].read()
    return torch.load(io.BytesIO(body))


def azure_client(spec: dict) -> Any:
    from azure.storage.blob import BlobServiceClient

    return BlobServiceClient.from_connection_string(spec["connection_string"]).get_container_client(spec["container"])


def torch_az_save(spec: dict, step: int, state: dict) -> None:
    """torch.save into memory and one upload by Azure's SDK."""
    buf = io.BytesIO()
    torch.save(state, buf)
    azure_client(spec).upload_blob(f"{spec['prefix']}/{step}.pt", buf.getvalue(), overwrite=True)


def torch_az_load(spec: dict, step: int, like: dict | None = None) -> Any:
    return torch.load(io.BytesIO(azure_client(spec).download_blob(f"{spec['prefix']}/{step}.pt").readall()))


def s3tc_config() -> Any:
    from s3torchconnector import S3ClientConfig

    return S3ClientConfig(force_path_style=True)


def s3checkpoint(spec: dict) -> Any:
    from s3torchconnector import S3Checkpoint

    return S3Checkpoint(region=REGION, endpoint=spec["endpoint"], s3client_config=s3tc_config())


def s3checkpoint_save(spec: dict, step: int, state: dict) -> None:
    """s3torchconnector's S3Checkpoint: torch.save streamed into a multipart upload."""
    with s3checkpoint(spec).writer(f"s3://{spec['bucket']}/{spec['prefix']}/{step}.pt") as w:
        torch.save(state, w)


def s3checkpoint_load(spec: dict, step: int, like: dict | None = None) -> Any:
    with s3checkpoint(spec).reader(f"s3://{spec['bucket']}/{spec['prefix']}/{step}.pt") as r:
        return torch.load(r)


def s3dcp_save(spec: dict, step: int, state: dict) -> None:
    """s3torchconnector's DCP writer (one process: no process group). Its client takes the
    endpoint from ``AWS_ENDPOINT_URL`` (set by :func:`main`)."""
    import torch.distributed.checkpoint as dcp
    from s3torchconnector.dcp import S3StorageWriter

    dcp.save(state, storage_writer=S3StorageWriter(REGION, f"s3://{spec['bucket']}/{spec['prefix']}/{step}",
                                                   s3client_config=s3tc_config()))


def s3dcp_load(spec: dict, step: int, like: dict | None = None) -> Any:
    """DCP loads into a state dict of the right shapes (a resume's model and optimizer)."""
    import torch.distributed.checkpoint as dcp
    from s3torchconnector.dcp import S3StorageReader

    assert like is not None
    dcp.load(like, storage_reader=S3StorageReader(REGION, f"s3://{spec['bucket']}/{spec['prefix']}/{step}",
                                                  s3client_config=s3tc_config()))
    return like


@dataclass(frozen=True)
class Method:
    saver: Callable[[dict], Any]  # spec -> a context manager yielding save(step, state)
    load: Callable[..., Any]  # (spec, step, like) -> the state
    where: str  # where its steps go: a make_spec kind
    fills: bool = False  # whether its load fills a state of the right shapes (``like``)
    imports: tuple[str, ...] = ()  # what a resume script has imported before it loads


AMBER = ("amber_store.store",)  # (amber_store imports its modules lazily)
S3TC = ("s3torchconnector", "s3torchconnector.dcp", "torch.distributed.checkpoint")
METHODS = {
    "torch.save, local file": Method(functools.partial(saver, torch_file_save), torch_file_load, "file"),
    "amber, local directory": Method(amber_saver, amber_load, "local", imports=AMBER),
    "torch.save, SeaweedFS S3": Method(functools.partial(saver, torch_s3_save), torch_s3_load, "s3",
                                       imports=("botocore.session",)),
    "amber, SeaweedFS S3": Method(amber_saver, amber_load, "amber-s3", imports=AMBER),
    "amber, SeaweedFS S3 via s3fs": Method(amber_saver, amber_load, "amber-s3fs", imports=AMBER),
    "torch.save, Azurite": Method(functools.partial(saver, torch_az_save), torch_az_load, "az",
                                  imports=("azure.storage.blob",)),
    "amber, Azurite": Method(amber_saver, amber_load, "amber-az", imports=AMBER),
    "amber, Azurite via adlfs": Method(amber_saver, amber_load, "amber-adlfs", imports=AMBER),
    "s3torchconnector S3Checkpoint": Method(functools.partial(saver, s3checkpoint_save), s3checkpoint_load, "s3",
                                            imports=S3TC),
    "s3torchconnector DCP": Method(functools.partial(saver, s3dcp_save), s3dcp_load, "s3", fills=True, imports=S3TC),
}
#: each server's methods are compared with the first, torch.save and one request of its own SDK
CLOUDS = {"SeaweedFS S3": ("torch.save, SeaweedFS S3", "amber, SeaweedFS S3", "amber, SeaweedFS S3 via s3fs",
                           "s3torchconnector S3Checkpoint", "s3torchconnector DCP"),
          "Azurite": ("torch.save, Azurite", "amber, Azurite", "amber, Azurite via adlfs")}
#: the server each kind of spec stores on
SERVER = {"s3": "SeaweedFS S3", "amber-s3": "SeaweedFS S3", "amber-s3fs": "SeaweedFS S3", "az": "Azurite",
          "amber-az": "Azurite", "amber-adlfs": "Azurite"}


def make_spec(kind: str, servers: dict[str, Any], tmp: Path) -> dict:
    """Where a method's run stores its steps (fresh each run)."""
    name = uuid.uuid4().hex
    s3, az = servers.get("SeaweedFS S3"), servers.get("Azurite")
    if kind in ("s3", "amber-s3", "amber-s3fs"):
        opts = s3.storage_options()
        return {"s3": {"endpoint": s3.endpoint, "key": s3.key, "secret": s3.secret, "bucket": "bench", "prefix": name},
                "amber-s3": {"uri": f"s3://bench/{name}", "options": opts},
                "amber-s3fs": {"uri": f"s3://bench/{name}", "options": {**opts, "client": "s3fs"}}}[kind]
    if kind in ("az", "amber-az", "amber-adlfs"):
        opts = az.storage_options()
        return {"az": {"connection_string": az.connection_string(), "container": "bench", "prefix": name},
                "amber-az": {"uri": f"az://bench/{name}", "options": opts},
                "amber-adlfs": {"uri": f"az://bench/{name}", "options": {**opts, "client": "adlfs"}}}[kind]
    return {"file": {"path": str(tmp / name)}, "local": {"uri": str(tmp / name), "options": None}}[kind]


def run_method(name: str, spec: dict, clock: Clock, state: dict, updated: dict) -> dict[str, Any]:
    """Save both steps, then load each in this process."""
    method = METHODS[name]
    with method.saver(spec) as save:
        full, info1 = clock(lambda: save(1, state))
        delta, info2 = clock(lambda: save(2, updated))
    like = {k: torch.empty_like(v) for k, v in state.items()} if method.fills else None
    load_full = clock(lambda: method.load(spec, 1, like))[0]
    load = clock(lambda: method.load(spec, 2, like))[0]
    out = {"full": full["s"], "delta": delta["s"], "load_full": load_full["s"], "load": load["s"],
           "full_ratio": getattr(info1, "ratio", 1.0), "delta_ratio": getattr(info2, "ratio", 1.0)}
    for what, t in (("full", full), ("delta", delta), ("load_full", load_full), ("load", load)):
        out[f"cpu_{what}"], out[f"server_cpu_{what}"] = t["cpu"], t["server_cpu"]
    return out


CHILD = r"""
import importlib, json, sys, time
t0 = time.perf_counter()
sys.path.insert(0, sys.argv[1])
from benchmarks import throughput as tp
name, spec, step, mb = sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
method = tp.METHODS[name]
for module in method.imports:
    importlib.import_module(module)
imports = time.perf_counter() - t0
like = {k: tp.torch.empty_like(v) for k, v in tp.make_state(mb).items()} if method.fills else None
c0, t0 = time.process_time(), time.perf_counter()
method.load(spec, step, like)
print(json.dumps({"s": time.perf_counter() - t0, "cpu": time.process_time() - c0, "imports": imports}))
"""


def cold_load(name: str, spec: dict, step: int, mb: int, server_pid: int | None) -> dict[str, float]:
    """Load ``step`` in a fresh process: its load's wall and CPU seconds, and the server's CPU
    seconds over the whole process (imports make no requests)."""
    s0 = server_cpu(server_pid)
    out = subprocess.run([sys.executable, "-c", CHILD, str(Path(__file__).resolve().parents[1]), name,
                          json.dumps(spec), str(step), str(mb)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1]) | {"server_cpu": server_cpu(server_pid) - s0}


def available(name: str, servers: dict[str, Any]) -> bool:
    """Whether the method's library is installed (s3torchconnector is not a dependency) and its
    server runs."""
    where = SERVER.get(METHODS[name].where)
    return (where is None or where in servers) and (
        not name.startswith("s3torchconnector") or importlib.util.find_spec("s3torchconnector") is not None)


@contextmanager
def started() -> Iterator[dict[str, Any]]:
    """The servers, each with a bucket "bench": SeaweedFS, and Azurite where it is installed."""
    from backends.azurite import Azurite, azurite_blob

    with contextlib.ExitStack() as stack:
        servers = {"SeaweedFS S3": stack.enter_context(SeaweedFS())}
        try:
            azurite_blob()
            servers["Azurite"] = stack.enter_context(Azurite())
        except FileNotFoundError:
            pass
        for server in servers.values():
            server.create_bucket("bench")
        yield servers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=128, help="approximate state size in MB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, help="also write the raw figures here")
    args = p.parse_args()
    compiled(Path(__file__).resolve().parents[1])
    state = make_state(args.mb)
    g = torch.Generator().manual_seed(1)
    updated = {k: v + 1e-3 * v.abs().mean() * torch.randn(v.shape, generator=g) for k, v in state.items()}
    mb = nbytes(state) / 1e6
    tmp = Path(tempfile.mkdtemp(prefix="amber-bench-"))
    try:
        with started() as servers:
            names = [n for n in METHODS if available(n, servers)]
            missing = [n for n in METHODS if n not in names]
            runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
            cold: dict[str, list[dict[str, Any]]] = {n: [] for n in names if METHODS[n].where in SERVER}
            s3 = servers["SeaweedFS S3"]
            # s3torchconnector's clients read credentials, and its DCP client the endpoint, from
            # the environment; the other clients are given theirs.
            os.environ.update(AWS_ACCESS_KEY_ID=s3.key, AWS_SECRET_ACCESS_KEY=s3.secret, AWS_ENDPOINT_URL=s3.endpoint,
                              AWS_REGION=REGION)
            for r in range(args.repeats):
                for name in rotated(names, r):
                    server = servers.get(SERVER.get(METHODS[name].where, ""))
                    pid = server.pid if server is not None else None
                    spec = make_spec(METHODS[name].where, servers, tmp)
                    runs[name].append(run_method(name, spec, Clock(pid), state, updated))
                    if name in cold:
                        cold[name].append({f"step {step}": cold_load(name, spec, step, args.mb, pid)
                                           for step in (1, 2)})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results = {n: {k: [run[k] for run in rs] for k in rs[0]} for n, rs in runs.items()}
    colds = {n: {f"{what}_{step}": [c[f"step {step}"][what] for c in cs] for step in (1, 2)
                 for what in ("s", "cpu", "server_cpu", "imports")} for n, cs in cold.items()}

    print(f"machine: {machine()}")
    print(f"state: {mb:.0f} MB float32 in {len(state)} tensors; {args.repeats} interleaved runs, "
          "MB/s median (range); the servers on this machine's loopback"
          + (f"; not installed: {', '.join(missing)}" if missing else "") + "\n")
    print(table(["method", "full save MB/s", "delta save MB/s", "load full step MB/s", "load delta step MB/s",
                 "full size ratio", "delta size ratio"],
                [[name, rate(mb, r["full"]), rate(mb, r["delta"]), rate(mb, r["load_full"]), rate(mb, r["load"]),
                  f"{r['full_ratio'][0]:.2f}x", f"{r['delta_ratio'][0]:.2f}x"] for name, r in results.items()]))
    def speedup(ours: list[float], peer: list[float]) -> str:
        return f"{statistics.median(peer) / statistics.median(ours):.2f}x"

    for cloud, (baseline, *_) in CLOUDS.items():
        if baseline not in results:
            continue
        base, base_cold = results[baseline], colds[baseline]
        print(f"\n{cloud}, speed against {baseline} (above 1: faster); cold: a fresh process per load, imports "
              "apart\n")
        print(table(["method", "save full", "save delta", "load full step", "load delta step", "cold load full step",
                     "cold load delta step"],
                    [[name, *(speedup(results[name][k], base[k]) for k in ("full", "delta", "load_full", "load")),
                      speedup(c["s_1"], base_cold["s_1"]), speedup(c["s_2"], base_cold["s_2"])]
                     for name, c in colds.items() if name in CLOUDS[cloud]]))
    gb = mb / 1e3
    print("\nCPU seconds per GB loaded (median), client process (every thread) and its server; cold: the fresh "
          "process's load\n")
    print(table(["method", "client, full step", "client, delta step", "server, full step", "server, delta step",
                 "client cold, full step", "client cold, delta step", "cold load s (full / delta)",
                 "imports s"],
                [[name, *(f"{statistics.median(results[name][k]) / gb:.2f}" for k in
                          ("cpu_load_full", "cpu_load", "server_cpu_load_full", "server_cpu_load")),
                  f"{statistics.median(c['cpu_1']) / gb:.2f}", f"{statistics.median(c['cpu_2']) / gb:.2f}",
                  f"{statistics.median(c['s_1']):.2f} / {statistics.median(c['s_2']):.2f}",
                  f"{statistics.median(c['imports_1'] + c['imports_2']):.2f}"] for name, c in colds.items()]))
    ours, s3fs = results["amber, SeaweedFS S3"], results["amber, SeaweedFS S3 via s3fs"]
    local, ts = results["amber, local directory"], results["torch.save, local file"]
    az, adlfs = results.get("amber, Azurite"), results.get("amber, Azurite via adlfs")

    def ratio(a: list[float], b: list[float]) -> str:
        return f"{median_rate(mb, a) / median_rate(mb, b):.2f}"

    print()
    for what in ("full", "delta", "load_full", "load"):
        print(f"{what:>9}: amber S3 / amber local = {ratio(ours[what], local[what])}; "
              f"S3 obstore / s3fs = {ratio(ours[what], s3fs[what])}; "
              + (f"Azure obstore / adlfs = {ratio(az[what], adlfs[what])}; " if az and adlfs else "")
              + f"amber local / torch.save local = {ratio(local[what], ts[what])} (throughput ratios: above 1 is faster)")
    if args.json:
        args.json.write_text(json.dumps({"mb": mb, "results": results, "cold": colds, "missing": missing}, indent=1))


if __name__ == "__main__":
    main()
