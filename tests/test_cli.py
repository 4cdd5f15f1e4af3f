"""The amber-store command line, end to end in subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import amber_store as amber
from conftest import flip_stored_byte

CLI = [sys.executable, "-m", "amber_store.cli"]


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


@pytest.fixture
def filled(tmp_path: Path) -> Path:
    uri = tmp_path / "ckpt"
    store = amber.open(uri, full_every=3)
    w = torch.zeros(64, 64)
    for step in range(1, 8):
        w[step] = step
        store.save(step * 10, {"model": {"w": w}, "optim": {"m": w * 2}, "step": step})
    return uri


def test_long_commands_draw_no_progress_bars_into_a_pipe(filled, tmp_path):
    torch.save({"w": torch.randn(256, 256)}, tmp_path / "in.pt")
    for args in (("verify", str(filled)), ("import", str(filled), "100", str(tmp_path / "in.pt"))):
        out = run(*args)  # stderr is a pipe here
        assert out.returncode == 0 and out.stderr == "", (args, out.stderr)


def test_ls_info_du_list_steps_and_bytes_as_text_and_json(filled):
    out = run("ls", str(filled))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:3] == ["step", "kind", "base"] and len(lines) == 8
    rows = json.loads(run("ls", str(filled), "--json").stdout)
    assert [r["step"] for r in rows] == [10, 20, 30, 40, 50, 60, 70]
    assert [r["kind"] for r in rows] == ["full", "delta", "delta"] * 2 + ["full"]
    info = json.loads(run("info", str(filled), "30", "--json").stdout)
    assert info["chain"] == [10, 30] and info["tensors"]["model/w"]["encoding"] == "diff"  # log bases
    assert "model/w" in run("info", str(filled), "30").stdout
    du = json.loads(run("du", str(filled), "--json").stdout)
    assert set(du["groups"]) == {"model", "optim"}


def test_verify_passes_then_fails_with_exit_1_on_a_flipped_byte(filled):
    ok = run("verify", str(filled), "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["ok"] is True
    flip_stored_byte(filled, amber.open(filled, mode="r"), 10, "optim/m")
    bad = run("verify", str(filled))
    assert bad.returncode == 1
    assert "FAIL step 10 tensor optim/m" in bad.stdout and "DAMAGED" in bad.stdout
    assert run("verify", str(filled), "40").returncode == 0  # a step outside that chain is fine


def test_gc_dry_run_changes_nothing_and_gc_keeps_the_policy(filled):
    dry = json.loads(run("gc", str(filled), "--keep-last", "2", "--keep-every", "30", "--dry-run", "--json").stdout)
    assert dry["keep"] == [30, 60, 70] and dry["dry_run"] is True
    assert amber.open(filled, mode="r").steps() == [10, 20, 30, 40, 50, 60, 70]
    assert run("pin", str(filled), "first", "10").returncode == 0
    real = run("gc", str(filled), "--keep-last", "2", "--keep-every", "30")
    assert real.returncode == 0, real.stderr
    assert amber.open(filled, mode="r").steps() == [10, 30, 60, 70]
    assert run("verify", str(filled)).returncode == 0


def test_export_and_import_round_trip_through_files(filled, tmp_path):
    out = run("export", str(filled), "50", str(tmp_path / "m.safetensors"))
    assert out.returncode == 0, out.stderr
    from safetensors.torch import load_file

    exported = load_file(tmp_path / "m.safetensors")
    assert torch.equal(exported["w"], amber.open(filled, mode="r").load(50)["model"]["w"].materialize())
    assert run("export", str(filled), "50", str(tmp_path / "all.pt")).returncode == 0
    imported = run("import", str(tmp_path / "other"), "1", str(tmp_path / "all.pt"))
    assert imported.returncode == 0, imported.stderr
    got = amber.open(tmp_path / "other", mode="r").load(1, lazy=False)
    assert got["step"] == 5 and torch.equal(got["optim"]["m"], exported["w"] * 2)


def test_errors_exit_2_with_a_one_line_message(filled, tmp_path):
    cases = [
        (("ls", "nosuch://x"), "unsupported URI scheme"),
        (("ls", "ftp://x"), "unsupported URI scheme 'ftp'; use a local path, file://, memory://, s3://"),
        (("info", str(filled), "11"), "step 11 is not committed"),
        (("ls", str(tmp_path / "missing")), "nothing to read"),
        (("export", str(filled), "10", str(tmp_path / "x.unknown")), "(CLI: --format)"),
        (("pin", str(filled), "nosuch"), "no pin named 'nosuch'"),
    ]
    for args, message in cases:
        out = run(*args)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert out.stderr.startswith("amber-store: error:") and message in out.stderr
        assert "Traceback" not in out.stderr
        as_json = run(*args, "--json")
        assert as_json.returncode == 2 and message in json.loads(as_json.stdout)["error"], as_json


def test_info_without_a_step_shows_the_latest_and_says_why_a_delta_step_stored_a_tensor_full(tmp_path):
    store = amber.open(tmp_path / "ckpt")
    store.save(1, {"w": torch.zeros(8, 8), "b": torch.zeros(4)})
    store.save(2, {"w": torch.zeros(8, 9), "b": torch.ones(4), "new": torch.ones(2)})
    out = run("info", str(tmp_path / "ckpt"))
    assert out.returncode == 0 and out.stdout.startswith("step 2: delta"), out
    assert "note: w: stored full: float32[8, 8] at base step 1, now float32[8, 9]" in out.stdout
    assert "note: new: stored full: new since base step 1" in out.stdout
    assert "note: b" not in out.stdout
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()[2:] if line.split()[0] in ("w", "b")}
    assert rows["b"][-2].startswith("~")  # packed: its share of the pack, so labelled
    assert "~: packed with the step's other small tensors" in out.stdout


def test_info_names_tensors_stored_full_for_one_reason_in_one_note(tmp_path):
    store = amber.open(tmp_path / "ckpt")
    for step in (1, 2, 3):  # deltas of fresh noise never pay: from step 3 on, the tensors are stored full
        store.save(step, {f"w{i}": torch.randn(512, 512) for i in range(5)})
    out = run("info", str(tmp_path / "ckpt"), "3")
    assert out.returncode == 0, out
    notes = [line for line in out.stdout.splitlines() if line.startswith("note:")]
    assert notes == ["note: 5 tensors (w0, w1, w2, ...): stored full: its delta against base step 1 no longer paid "
                     "(full_above)"]


def test_ls_shows_times_pins_and_no_ratio_for_a_step_that_stored_nothing(tmp_path):
    store = amber.open(tmp_path / "ckpt")
    state = {"w": torch.ones(256)}
    store.save(1, state)
    store.save(2, state)  # nothing changed: nothing stored
    store.pin(1, "first")
    rows = json.loads(run("ls", str(tmp_path / "ckpt"), "--json").stdout)
    assert rows[0]["pins"] == ["first"] and rows[1]["pins"] == []
    assert rows[1]["nbytes_stored"] == 0 and rows[1]["ratio"] is None
    assert rows[0]["created"][:2] == "20"
    text = run("ls", str(tmp_path / "ckpt")).stdout.splitlines()
    assert text[1].rstrip().endswith("first") and " - " in text[2]
    assert json.loads(run("pins", str(tmp_path / "ckpt"), "--json").stdout) == {"first": 1}
    run("pin", str(tmp_path / "ckpt"), "first")  # unpinned
    assert run("pins", str(tmp_path / "ckpt")).stdout == "no pins\n"


def test_a_reader_that_stops_early_gets_no_traceback(tmp_path):
    store = amber.open(tmp_path / "ckpt")
    store.save(1, {f"layer{i}": torch.zeros(2) for i in range(3000)})  # ~200 KB of info, beyond a pipe's buffer
    out = subprocess.run(f"{' '.join(CLI)} info {tmp_path / 'ckpt'} | head -1", shell=True, capture_output=True,
                         text=True, timeout=300)
    assert out.stdout.startswith("step 1: full")
    assert "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr, out.stderr


def test_du_counts_objects_and_allocated_bytes(filled):
    du = json.loads(run("du", str(filled), "--json").stdout)
    files = [p for p in filled.rglob("*") if p.is_file()]
    assert du["storage"]["objects"] == len(files)
    assert du["storage"]["bytes"] == sum(p.stat().st_size for p in files)
    assert du["storage"]["allocated"] >= du["storage"]["bytes"]
    assert "allocated" in run("du", str(filled)).stdout


def test_safetensors_export_of_a_subtree_imports_back_under_it_with_the_usual_file_mode(filled, tmp_path):
    out = tmp_path / "model.safetensors"
    assert run("export", str(filled), "50", str(out), "--subtree", "model").returncode == 0
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask
    assert run("import", str(tmp_path / "other"), "1", str(out)).returncode == 0
    back = amber.open(tmp_path / "other", mode="r").load(1, lazy=False)
    assert list(back) == ["model"]
    assert torch.equal(back["model"]["w"], amber.open(filled, mode="r").load(50)["model"]["w"].materialize())
    assert run("import", str(tmp_path / "top"), "1", str(out), "--subtree", "").returncode == 0
    assert list(amber.open(tmp_path / "top", mode="r").load(1)) == ["w"]


@pytest.mark.s3
def test_missing_credentials_on_s3_exit_2_without_a_traceback(s3_server, tmp_path):
    env = {"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"), "AWS_CONFIG_FILE": str(tmp_path / "none"),
           "AWS_EC2_METADATA_DISABLED": "true", "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""}
    endpoint = s3_server.storage_options()["endpoint_url"]
    out = run("ls", "s3://amber-test/none", "--endpoint-url", endpoint, env=env)
    assert out.returncode == 2 and "credentials" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.s3
def test_writing_commands_refuse_a_server_without_conditional_writes_unless_single_writer():
    from backends.s3servers import RcloneS3

    with RcloneS3() as server:
        server.create_bucket("amber-test")
        opts = server.storage_options()
        with amber.open("s3://amber-test/run", opts, single_writer=True) as store:
            store.save(1, {"x": torch.ones(3)})
        where = ["s3://amber-test/run", "--endpoint-url", opts["endpoint_url"],
                 "--storage-option", f"key={opts['key']}", "--storage-option", f"secret={opts['secret']}"]
        refused = run("pin", *where, "best", "1")
        assert refused.returncode == 2 and "ignores conditional writes" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
        assert run("pin", *where, "best", "1", "--single-writer").returncode == 0
        listed = run("ls", *where, "--json")  # reading never checks
        assert listed.returncode == 0, listed.stderr


def test_the_demo_wipes_only_its_own_earlier_store_unless_forced(tmp_path):
    from amber_store.demo import run as demo

    real = tmp_path / "real"
    amber.open(real).save(5, {"w": torch.ones(3)})
    quiet = {"steps": 20, "every": 10, "out": lambda line: None, "progress": False}
    with pytest.raises(amber.AmberError, match="not the demo's .* --force"):
        demo(str(real), **quiet)
    assert amber.open(real, mode="r").steps() == [5]  # untouched
    refused = run("demo", "--uri", str(real), "--steps", "20")
    assert refused.returncode == 2 and "--force" in refused.stderr
    assert demo(str(tmp_path / "demo"), **quiet)["verified"]
    assert demo(str(tmp_path / "demo"), **quiet)["verified"]  # an earlier demo's store is wiped
    assert demo(str(real), force=True, **quiet)["verified"]
    assert amber.open(real, mode="r").steps() == [10, 20]


def test_commands_that_read_no_tensor_do_not_import_torch(filled):
    code = ("import sys, amber_store, amber_store.cli as cli\n"
            "cli.parser().format_help(); amber_store.AmberError\n"
            "for command in ('ls', 'pins', 'info', 'du'):\n"
            "    assert cli.main([command, sys.argv[1]]) == 0\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code, str(filled)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "False" and "step" in out.stdout


def test_an_unsupported_scheme_is_refused_before_any_io():
    with pytest.raises(amber.InvalidURIError, match="unsupported URI scheme 'ftp'"):
        amber.open("ftp://example.invalid/ckpt")


def test_rm_deletes_one_step_and_every_other_step_still_verifies(filled):
    dry = json.loads(run("rm", str(filled), "40", "--dry-run", "--json").stdout)
    assert dry["delete"] == [40] and dry["rewrite"] == [50, 60]  # deltas on the full step 40
    assert amber.open(filled, mode="r").steps() == [10, 20, 30, 40, 50, 60, 70]
    out = run("rm", str(filled), "40")
    assert out.returncode == 0 and "fold 2 step(s)" in out.stdout, out
    assert amber.open(filled, mode="r").steps() == [10, 20, 30, 50, 60, 70]
    assert run("verify", str(filled)).returncode == 0
