"""Fault tallies against real S3 servers: SeaweedFS killed (SIGKILL) and frozen (SIGSTOP) at
random moments of a save, writers racing on one step, and a server without conditional writes.

Kill trials: one writer saves step after step while the server is killed at a random moment;
the server restarts on the same data and the *same* Store object saves on. Counted: committed
steps lost, partial steps visible, steps committed although the writer saw an error (the answer
was lost; the writer adopts them), bit-exactness of every step after all trials.
Freeze trials: the server is frozen mid-save; the save must fail within ``save_timeout``.

    python benchmarks/s3_faults.py --kills 20 --freezes 5 --races 20
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import amber_store as amber  # noqa: E402
from backends.s3servers import RcloneS3, SeaweedFS  # noqa: E402
from benchmarks.common import machine, table  # noqa: E402
from tests.conftest import save_at_once  # noqa: E402

BUCKET = "faults"


def state(step: int, mb: int) -> dict[str, torch.Tensor]:
    """The state saved at ``step``: a drifting weight-like tensor set of about ``mb`` MB."""
    g = torch.Generator().manual_seed(0)
    base = {f"w{i}": torch.randn(mb * (1 << 18) // 8, generator=g) for i in range(8)}
    g.manual_seed(step)
    return {k: v + 1e-3 * step * torch.randn(v.shape, generator=g) for k, v in base.items()}


def bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)) for k in a)


def kill_trials(n: int, mb: int, rng: random.Random) -> dict[str, object]:
    tally = {"trials": n, "kills while saving in a loop": 0, "committed steps lost": 0, "partial steps visible": 0,
             "commits adopted after a lost answer": 0, "re-saves after restart ok": 0, "steps checked bit-exact": 0}
    with SeaweedFS() as server:
        server.create_bucket(BUCKET)
        uri, opts = f"s3://{BUCKET}/{uuid.uuid4().hex}", server.storage_options()
        store = amber.open(uri, opts, pack_threshold=0, save_timeout=60)
        saved: set[int] = set()
        step = 1
        for _ in range(n):
            saving = threading.Event()

            def saver() -> None:
                nonlocal step
                while True:
                    try:
                        saving.set()
                        store.save(step, state(step, mb))
                        saved.add(step)
                        step += 1
                    except amber.AmberError:
                        return

            t = threading.Thread(target=saver)
            t.start()
            saving.wait()
            time.sleep(rng.uniform(0.05, 1.5))
            server.kill()
            tally["kills while saving in a loop"] += 1
            t.join()
            server.restart()
            listed = set(amber.open(uri, opts, mode="r").steps())
            tally["committed steps lost"] += len(saved - listed)
            if step in listed:  # committed, but its answer never reached the writer
                tally["commits adopted after a lost answer"] += 1
                saved.add(step)
                step += 1
            tally["partial steps visible"] += len(listed - saved)
            store.save(step, state(step, mb))  # the same writer, same Store object
            saved.add(step)
            step += 1
            tally["re-saves after restart ok"] += 1
        reader = amber.open(uri, opts, mode="r")
        for k in sorted(saved):
            if bit_equal(reader.load(k, lazy=False), state(k, mb)):
                tally["steps checked bit-exact"] += 1
        tally["steps saved"] = len(saved)
    return tally


def freeze_trials(n: int, mb: int, timeout: float, rng: random.Random) -> dict[str, object]:
    delays = []
    with SeaweedFS() as server:
        server.create_bucket(BUCKET)
        uri, opts = f"s3://{BUCKET}/{uuid.uuid4().hex}", server.storage_options()
        store = amber.open(uri, opts, pack_threshold=0, save_timeout=timeout)
        step, failed, resaved, longest = 1, 0, 0, 0.0
        store.save(step, state(step, mb))
        for _ in range(n):
            step += 1
            timer = threading.Timer(rng.uniform(0.0, 0.3), server.freeze)
            t0 = time.monotonic()
            timer.start()
            try:
                store.save(step, state(step, mb))
            except amber.StorageAccessError:
                failed += 1
                delays.append(time.monotonic() - t0)
            longest = max(longest, time.monotonic() - t0)
            timer.join()
            server.thaw()
            step += 1
            store.save(step, state(step, mb))
            resaved += 1
    return {"trials": n, "save_timeout s": timeout, "saves failed": failed,
            "time to error s, median": round(statistics.median(delays), 2) if delays else "-",
            "time to error s, max": round(max(delays), 2) if delays else "-",
            "longest save s (a freeze may land after a save ends)": round(longest, 2), "re-saves after thaw ok": resaved}


def race_rounds(n: int) -> dict[str, object]:
    outcomes: dict[str, int] = {"rounds": n, "exactly one commit": 0, "loser ConcurrentWriterError": 0,
                                "loser StepOrderError (started after the winner)": 0, "other": 0}
    with SeaweedFS() as server:
        server.create_bucket(BUCKET)
        uri, opts = f"s3://{BUCKET}/{uuid.uuid4().hex}", server.storage_options()
        amber.open(uri, opts).save(0, state(0, 1))
        for step in range(1, n + 1):
            stores = [amber.open(uri, opts), amber.open(uri, opts)]
            results = save_at_once(stores, step, [state(100 * step + i, 1) for i in range(2)])
            won = [r for r in results if isinstance(r, amber.CommitInfo)]
            lost = [r for r in results if not isinstance(r, amber.CommitInfo)]
            if len(won) == 1:
                outcomes["exactly one commit"] += 1
            if len(lost) == 1 and isinstance(lost[0], amber.ConcurrentWriterError):
                outcomes["loser ConcurrentWriterError"] += 1
            elif len(lost) == 1 and isinstance(lost[0], amber.StepOrderError):
                outcomes["loser StepOrderError (started after the winner)"] += 1
            else:
                outcomes["other"] += 1
    return outcomes


def rclone_refused() -> str:
    with RcloneS3() as server:
        server.create_bucket(BUCKET)
        try:  # (a new store is checked at its first save: opening creates nothing)
            amber.open(f"s3://{BUCKET}/run", server.storage_options()).save(1, {"x": torch.ones(1)})
        except amber.UnsafeStorageError:
            return "refused at its first save (UnsafeStorageError), before any data"
        return "NOT refused"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--freezes", type=int, default=5)
    p.add_argument("--races", type=int, default=20)
    p.add_argument("--mb", type=int, default=16, help="state size per save")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the tallies here")
    args = p.parse_args()
    rng = random.Random(args.seed)
    print(f"`python benchmarks/s3_faults.py --kills {args.kills} --freezes {args.freezes} --races {args.races}`; "
          f"machine: {machine()}; state {args.mb} MB in 8 tensors, one object each\n")
    tallies = {"SeaweedFS killed (SIGKILL) at a random moment, restarted": kill_trials(args.kills, args.mb, rng),
               "SeaweedFS frozen (SIGSTOP) mid-save": freeze_trials(args.freezes, args.mb, 3.0, rng),
               "Two writers racing on each step (SeaweedFS)": race_rounds(args.races)}
    for title, tally in tallies.items():
        print(f"**{title}**\n")
        print(table(["", "count"], [[k, v] for k, v in tally.items()]))
        print()
    refused = rclone_refused()
    print(f"rclone serve s3 (ignores If-None-Match): {refused}")
    if args.json:
        args.json.write_text(json.dumps({**tallies, "rclone": refused}, indent=1))


if __name__ == "__main__":
    main()
