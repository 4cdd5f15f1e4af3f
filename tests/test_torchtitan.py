"""torchtitan's trainer checkpointing into an amber-store through one config line
(amber_store.integrations.torchtitan), on 2 gloo ranks: saves, keep_latest_k, a kill, a resume
bit-exact and training continued bit-exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan.components.checkpointer")

import amber_store as amber  # noqa: E402
from backends.process import free_port  # noqa: E402

WORKER = Path(__file__).parent / "torchtitan_workers.py"
STEPS = 7


def train(dump: Path, **options) -> list[dict]:
    """The worker's loop on 2 ranks; rank 0's events."""
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(dump), json.dumps({"steps": STEPS, **options})],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, f"rank failed:\n{err[-4000:]}"
        outs.append(out)
    return [json.loads(line) for line in outs[0].splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, str]:
    """Each step's state digest in a run that never stops (checkpointing off)."""
    events = train(tmp_path_factory.mktemp("reference"), checkpoint={"enable": False})
    return {e["step"]: e["digest"] for e in events if "step" in e}


@pytest.mark.parametrize("async_mode", ["disabled", "async", "async_with_pinned_mem"])
def test_torchtitan_run_killed_and_resumed_continues_bit_exact_and_keeps_latest_k(tmp_path, async_mode,
                                                                                 uninterrupted):
    checkpoint = {"enable": True, "interval": 2, "keep_latest_k": 2, "async_mode": async_mode,
                  "last_save_model_only": True, "export_dtype": "bfloat16"}
    first = train(tmp_path, stop=5, checkpoint=checkpoint)  # saves 2 and 4, killed after step 5
    assert first[0] == {"loaded": 0, "digest": first[0]["digest"]}
    assert [e["digest"] for e in first if "step" in e] == [uninterrupted[s] for s in range(1, 6)]
    store = amber.open(tmp_path / "checkpoint" / "amber", mode="r")
    assert store.steps() == [2, 4]

    second = train(tmp_path, checkpoint=checkpoint)  # a new job with the same config resumes
    assert second[0] == {"loaded": 4, "digest": uninterrupted[4]}
    assert [e["digest"] for e in second if "step" in e] == [uninterrupted[s] for s in (5, 6, 7)]
    # step 7 is torchtitan's last save, the model alone in bfloat16: kept, but no resume point
    assert second[-1] == {"resume_step": 6}
    store = amber.open(tmp_path / "checkpoint" / "amber", mode="r")
    assert store.steps() == [4, 6, 7]  # keep_latest_k=2 deleted step 2 after step 6's commit
    assert store.manifest(6).kind == "delta"
    assert "optimizer" not in store.load(7) and {t.dtype for t in store.manifest(7).tensors.values()} == {"bfloat16"}
    # step 4 was folded off the deleted step 2 and still holds the state it resumed from
    assert {"optimizer", "lr_scheduler", "dataloader", "train_state"} <= set(store.load(4))


class _Loader:
    def __init__(self) -> None:
        self.loaded = None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        self.loaded = state_dict


class _Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_dataloader_state_that_would_run_code_is_refused_before_torchtitan_unpickles_it():
    import pickle

    from amber_store.errors import UnsafeValueError
    from amber_store.integrations.torchtitan import _CheckedPickles

    loader = _Loader()
    plain = {"dp_rank_0": pickle.dumps({"_num_yielded": 5, "state": [1, 2.5, "x", None, b"\0"]}), "world_size": 2}
    _CheckedPickles(loader).load_state_dict(plain)
    assert loader.loaded == plain
    crafted = {"dp_rank_0": pickle.dumps(_Payload()), "world_size": 2}
    with pytest.raises(UnsafeValueError, match="allow_pickle"):
        _CheckedPickles(_Loader()).load_state_dict(crafted)
