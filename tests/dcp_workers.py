"""Worker processes for the multi-rank tests: ``python tests/dcp_workers.py JOB URI OPTIONS_JSON``.

torch.distributed's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) comes from the
test; WORLD_SIZE=1 without MASTER_PORT means a single process without a process group.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from amber_store import dcp as amber_dcp
from amber_store import stepwriter
from amber_store.dcp import AmberStorageReader, AmberStorageWriter

SHAPE = (10, 24)  # 10 rows split unevenly over 3 ranks: 4, 4, 2


def expected(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(SHAPE, generator=g), "emb": torch.randn(64, 32, generator=g),
             "bias": torch.randn(24, generator=g)}
    if version >= 2:  # a small update: one row of w, nothing else
        state["w"][3] += 1.0
    return state


def sharded(state: dict[str, torch.Tensor], mesh) -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    return {"w": distribute_tensor(state["w"], mesh, [Shard(0)]),
            "emb": distribute_tensor(state["emb"], mesh, [Shard(1)]),
            "bias": distribute_tensor(state["bias"], mesh, [Replicate()]),
            "meta": {"lr": 0.01, "version": 1}}


def gathered(obj):
    """``obj`` with every DTensor gathered into its full tensor (a collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return obj.full_tensor()
    if isinstance(obj, dict):
        return {k: gathered(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [gathered(v) for v in obj]
    return obj


def fsdp_model() -> torch.nn.Module:
    """An MLP with FSDP2 (fully_shard) on each layer and the root: every parameter a DTensor,
    sharded by rows over the ranks."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    return fully_shard(model)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> tuple[dict, dict]:
    """One AdamW step on the batch of ``step`` (the same on every rank); the state dicts after it."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(step)
    model(torch.randn(8, 64)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    return get_state_dict(model, optimizer)


def expect_failure(rank: int, save) -> None:
    """Run ``save``, which must fail; print the failure (DCP raises a CheckpointException, a
    BaseException, on every rank, carrying each failed rank's error)."""
    try:
        save()
    except BaseException as e:
        if isinstance(e, (SystemExit, KeyboardInterrupt)):
            raise
        print(f"rank {rank}: save failed as expected: {type(e).__name__}: {e}".replace("\n", " "), flush=True)
    else:
        raise SystemExit("the save should have failed")


def main() -> None:
    job, uri, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    store_options = options.pop("store", {})  # the rest are storage options
    world = int(os.environ.get("WORLD_SIZE", "1"))
    distributed = "MASTER_PORT" in os.environ
    mesh = None
    if distributed:  # a collective that never completes fails in a minute, naming itself in stderr
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
    rank = dist.get_rank() if distributed else 0
    try:
        if job == "save":  # two consecutive saves; the second changes one row of w
            for version in (1, 2):
                dcp.save(sharded(expected(version), mesh), storage_writer=AmberStorageWriter(uri, options))
        elif job == "fail":  # one rank raises in the middle of its writes
            original = AmberStorageWriter.write_data

            def failing(self, plan, planner):
                if rank == world - 1:
                    raise RuntimeError(f"rank {rank} fails mid-save")
                return original(self, plan, planner)

            AmberStorageWriter.write_data = failing
            try:
                dcp.save(sharded(expected(2), mesh), storage_writer=AmberStorageWriter(uri, options))
            except BaseException as e:  # DCP's CheckpointException is a BaseException, raised on every rank
                if isinstance(e, (SystemExit, KeyboardInterrupt)):
                    raise
                print(f"rank {rank}: save failed as expected: {type(e).__name__}", flush=True)
            else:
                raise SystemExit("the save should have failed")
        elif job == "interleaved":  # step 1; then, once the test says so, step 3
            go = Path(options.pop("go"))
            dcp.save(sharded(expected(1), mesh), storage_writer=AmberStorageWriter(uri, options, step=1, **store_options))
            if rank == 0:
                while not go.exists():
                    time.sleep(0.05)
            if distributed:
                dist.barrier()
            expect_failure(rank, lambda: dcp.save(sharded(expected(2), mesh),
                                                  storage_writer=AmberStorageWriter(uri, options, step=3,
                                                                                    **store_options)))
        elif job == "fail_after_write":  # the last rank fails after writing an object; then a save succeeds
            original_put = stepwriter.StepWriter._put

            def put_then_fail(self, key, parts, weight):
                original_put(self, key, parts, weight)
                if rank == world - 1:
                    from concurrent.futures import wait
                    wait(list(self._writes))
                    raise RuntimeError(f"rank {rank} fails after writing {key}")

            stepwriter.StepWriter._put = put_then_fail
            expect_failure(rank, lambda: dcp.save(sharded(expected(1), mesh),
                                                  storage_writer=AmberStorageWriter(uri, options, step=1,
                                                                                    **store_options)))
            stepwriter.StepWriter._put = original_put
            if rank == 0:
                held = amber_dcp._PROCESS[uri]
                from conftest import all_keys
                keys = all_keys(held.store, held.unfinished.group + "/")
                print("FAILED", held.unfinished.group, *keys, flush=True)
            dcp.save(sharded(expected(2), mesh), storage_writer=AmberStorageWriter(uri, options, step=2, **store_options))
        elif job == "hang":  # the last rank's storage stops answering its data writes
            if rank == world - 1:
                from amber_store.storage.local import LocalBackend
                original = LocalBackend.put_object

                async def hang(self, key, parts, durable=False):
                    if not key.endswith("zarr.json"):  # its data, not the group's metadata
                        await asyncio.sleep(3600)
                    return await original(self, key, parts, durable)

                LocalBackend.put_object = hang
            t0 = time.monotonic()
            expect_failure(rank, lambda: dcp.save(sharded(expected(2), mesh),
                                                  storage_writer=AmberStorageWriter(uri, options, step=5, full=True,
                                                                                    **store_options)))
            print(f"rank {rank}: failed after {time.monotonic() - t0:.1f} s", flush=True)
        elif job == "fsdp":  # an FSDP2 model and AdamW, saved at training steps 10 and 20 (and as DCP files)
            out = Path(options.pop("out"))
            model = fsdp_model()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            for step in (10, 20):
                msd, osd = train_step(model, optimizer, step)
                state = {"model": msd, "optim": osd, "step": step, "run": {"name": "mlp", "seed": 0}}
                dcp.save(state, storage_writer=AmberStorageWriter(uri, options, step=step, **store_options))
                expected_state = gathered(state)
                if rank == 0:
                    torch.save(expected_state, out / f"expected_{step}.pt")
            dcp.save(state, checkpoint_id=str(out / "dcp"))  # DCP's own FileSystemWriter, for import
        elif job == "killed":  # FSDP2 steps 10 and 20; the victim rank is killed while writing step 20
            import signal

            out, victim = Path(options.pop("out")), int(options.pop("victim"))
            model = fsdp_model()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            for step in (10, 20):
                msd, osd = train_step(model, optimizer, step)
                state = {"model": msd, "optim": osd, "step": step}
                full = gathered(state)
                if rank == 0:
                    torch.save(full, out / f"expected_{step}.pt")
                save = lambda: dcp.save(state, storage_writer=AmberStorageWriter(uri, options, step=step,  # noqa: E731
                                                                                 **store_options))
                if step == 10:
                    save()
                    continue
                if rank == victim:  # its items are written; it dies before it seals them
                    from amber_store.writer import Writer

                    def die(*args, **kwargs):
                        print(f"rank {rank}: killed mid-save", flush=True)
                        os.kill(os.getpid(), signal.SIGKILL)

                    Writer.seal_rank = die
                t0 = time.monotonic()
                expect_failure(rank, save)
                print(f"rank {rank}: failed after {time.monotonic() - t0:.1f} s", flush=True)
        elif job == "fsdp_resume":  # resume the FSDP2 model and AdamW at the latest step, check it, save and gc
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            import amber_store as amber

            out = Path(options.pop("out"))
            model = fsdp_model()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            msd, osd = train_step(model, optimizer, 0)  # (AdamW's state exists from a first step)
            state = {"model": msd, "optim": osd, "step": -1}
            dcp.load(state, storage_reader=AmberStorageReader(uri, options))
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
            msd, osd = get_state_dict(model, optimizer)
            got = gathered({"model": msd, "optim": osd, "step": state["step"]})
            if rank == 0:
                torch.save(got, out / f"resumed_{world}.pt")
            step = state["step"] + 10
            msd, osd = train_step(model, optimizer, step)
            dcp.save({"model": msd, "optim": osd, "step": step},
                     storage_writer=AmberStorageWriter(uri, options, step=step, **store_options))
            if rank == 0:
                report = amber.open(uri, options or None, mode="a").gc(keep_last=2, grace_seconds=0)
                print(f"rank 0: resumed at step {state['step']}, saved step {step}, gc removed "
                      f"{report.objects_removed} objects", flush=True)
        elif job == "manager":  # a sharded CheckpointManager: "train" saves steps 2, 4, 6; "resume" restores one
            from torch.distributed.checkpoint.state_dict import get_state_dict

            from amber_store.manager import CheckpointManager

            out, phase, restore = Path(options.pop("out")), options.pop("phase"), options.pop("restore", None)
            model = fsdp_model()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

            def state():
                msd, osd = get_state_dict(model, optimizer)
                return gathered({"model": msd, "optim": osd})

            manager = CheckpointManager(uri, every=2, keep_last=2, storage_options=options or None, **store_options)
            start = 0
            if phase == "resume":
                start = manager.restore(model, optimizer, step=restore)
                restored = {"state": state(), "step": start, "extra": manager.extra}
                if rank == 0:
                    torch.save(restored, out / f"restored_{world}.pt")
            for step in range(start + 1, 7):
                torch.manual_seed(step)  # the same batch on every rank
                model(torch.randn(8, 64)).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
                if phase == "train":
                    if step == 4:  # (gathered before the save, not beside it)
                        at_4 = state()
                        if rank == 0:
                            torch.save(at_4, out / "state_4.pt")
                    manager.maybe_save(step, model=model, optimizer=optimizer, extra={"data_pos": step * 8})
            manager.close()
            final = state()
            if rank == 0:
                torch.save(final, out / f"final_{phase}_{world}.pt")
        elif job == "open_fails":  # one rank fails to open the store (an interrupt, or an error)
            from amber_store.manager import CheckpointManager

            failing, how = int(options.pop("rank")), options.pop("how")
            if rank == failing:
                def fail(*args, **kwargs):
                    raise KeyboardInterrupt if how == "interrupt" else PermissionError("no access on this host")

                amber_dcp._process = fail
            t0 = time.monotonic()
            try:
                CheckpointManager(uri, storage_options=options or None, **store_options)
            except BaseException as e:  # (KeyboardInterrupt included: it is what this rank met)
                print(f"rank {rank}: {type(e).__name__} after {time.monotonic() - t0:.1f} s: {e}", flush=True)
            else:
                print(f"rank {rank}: opened", flush=True)
        elif job == "load":  # into DTensors of this world size, or full tensors in one process
            want = expected(int(options.pop("version", 2)))
            step = options.pop("step", None)
            if distributed:
                state = sharded({k: torch.zeros_like(v) for k, v in want.items()}, mesh)
                dcp.load(state, storage_reader=AmberStorageReader(uri, options, step=step))
                full = {k: state[k].full_tensor() for k in want}
            else:
                full = {k: torch.zeros_like(v) for k, v in want.items()}
                dcp.load(full, storage_reader=AmberStorageReader(uri, options, step=step))
            for k, v in want.items():
                assert torch.equal(full[k].view(torch.int32), v.view(torch.int32)), (rank, k)
            print(f"rank {rank}: loaded bit-exact", flush=True)
        else:
            raise SystemExit(f"unknown job {job}")
    finally:
        if distributed:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Exit without interpreter teardown: destructors of torch/gloo threads at exit sometimes
    # abort ("terminate called without an active exception") after all work succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
