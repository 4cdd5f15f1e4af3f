"""``amber-store``: list, inspect, verify, garbage-collect, export and import checkpoints; the demo."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any, Sequence

from . import errors as amber_errors
from .errors import AmberError


def _storage_options(args: argparse.Namespace) -> dict[str, Any] | None:
    opts: dict[str, Any] = {}
    if args.endpoint_url:
        opts["endpoint_url"] = args.endpoint_url
    for item in args.storage_option or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"amber-store: error: --storage-option wants KEY=VALUE, got {item!r}")
        opts[key] = json.loads(value) if value[:1] in "{[0123456789" or value in ("true", "false") else value
    return opts or None


#: stores and histories a command opened: closed before the process exits, so that no client
#: session is left to be torn down half-way at exit ("Unclosed client session")
_OPENED: list[Any] = []


def _open(args: argparse.Namespace, mode: str = "r") -> Any:
    import amber_store as amber

    store = amber.open(args.uri, _storage_options(args), mode=mode, progress=_progress(args),
                       single_writer=args.single_writer)
    _OPENED.append(store)
    return store


def _progress(args: argparse.Namespace) -> bool:
    """Progress bars for a person at a terminal: not with --json, not into a pipe or a log."""
    return not args.json and sys.stderr.isatty()


def _usage(history: Any) -> Any:
    """What ``history``'s store holds (:class:`~amber_store.usage.Usage`)."""
    from .usage import Usage

    return Usage(history)


def _history(args: argparse.Namespace) -> Any:
    """The store's commits, read only, for commands that read no tensor: no torch import."""
    from .history import History
    from .storage import connect

    history = History(connect(args.uri, _storage_options(args), read_only=True))
    _OPENED.append(history)
    _sync(history.require_root())
    return history


def _sync(coro: Any) -> Any:
    """Run a coroutine on amber-store's event loop."""
    from .runtime import sync

    return sync(coro)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _ratio(raw: int, stored: int) -> float | None:
    """Raw per stored bytes; ``None`` when nothing was stored (an unchanged step)."""
    return raw / stored if stored else None


def cmd_ls(args: argparse.Namespace) -> int:
    history = _history(args)
    pins: dict[int, list[str]] = {}
    for name, step in _sync(history.pins()).items():
        pins.setdefault(step, []).append(name)
    rows = []
    for step in _sync(history.steps()):
        m = _sync(history.manifest(step))
        rows.append({"step": step, "kind": m.kind, "base": m.base, "created": _iso(m.created),
                     "nbytes_raw": m.nbytes_raw, "nbytes_stored": m.nbytes_stored,
                     "ratio": _ratio(m.nbytes_raw, m.nbytes_stored), "tensors": len(m.tensors),
                     "pins": sorted(pins.get(step, []))})
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'step':>10} {'kind':>5} {'base':>10} {'created (UTC)':>19} {'raw':>10} {'stored':>10} {'ratio':>8} "
          f"{'tensors':>7}  pins")
    for r in rows:
        base = "-" if r["base"] is None else r["base"]
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.1f}x"
        print(f"{r['step']:>10} {r['kind']:>5} {base:>10} {r['created']:>19} {_human(r['nbytes_raw']):>10} "
              f"{_human(r['nbytes_stored']):>10} {ratio:>8} {r['tensors']:>7}  {','.join(r['pins'])}")
    stray = _sync(_usage(history).uncommitted())
    if stray["attempts"] or stray["uploads"]:
        print(_strays(args, stray))
    return 0


def _strays(args: argparse.Namespace, stray: dict[str, int]) -> str:
    """A line on the data of attempts no committed step uses (dead saves, or folds of a gc that
    died: :meth:`History.uncommitted`), and what removes it."""
    young = stray["maybe_saving"]
    note = f"; {young} of them may be a save in progress (gc spares those for an hour)" if young else ""
    uploads = (f"; {stray['uploads']} upload(s) in parts never completed (billed, not listed), which gc aborts "
               "once an hour old" if stray["uploads"] else "")
    return (f"uncommitted: {stray['attempts']} attempt(s) no committed step uses hold {_human(stray['bytes'])}, which "
            f"`amber-store gc {args.uri}` deletes{note}{uploads}")


def _iso(t: float) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def cmd_info(args: argparse.Namespace) -> int:
    history = _history(args)
    step = args.step
    if step is None:  # the latest
        steps = _sync(history.steps())
        if not steps:
            raise amber_errors.StepNotFoundError(f"{history.uri}: the store is empty (no committed step)")
        step = steps[-1]
    info = _sync(_usage(history).info(step))
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    print(f"step {info['step']}: {info['kind']}, base {info['base']}, chain {info['chain']}, "
          f"{_human(info['nbytes_stored'])} stored of {_human(info['nbytes_raw'])} raw")
    print(f"{'tensor':<48} {'dtype':>9} {'shape':>16} {'enc':>5} {'base':>8} {'stored':>10}")
    for key, t in info["tensors"].items():
        base = "-" if t["base"] is None else t["base"]
        shards = f"  ({t['shards']} shards)" if t.get("shards", 1) > 1 else ""
        stored = ("~" if t["packed"] else "") + _human(t["nbytes_stored"])
        print(f"{key:<48} {t['dtype']:>9} {str(tuple(t['shape'])):>16} {t['encoding']:>5} {base:>8} "
              f"{stored:>10}{shards}")
    if any(t["packed"] for t in info["tensors"].values()):
        print("~: packed with the step's other small tensors, compressed together: a share of the pack by raw "
              "size, not a measurement")
    notes: dict[str, list[str]] = {}  # (thousands of tensors may share one, e.g. full_above's)
    for key, t in info["tensors"].items():
        if t["note"]:
            notes.setdefault(t["note"], []).append(key)
    for note, keys in notes.items():
        named = keys[0] if len(keys) == 1 else f"{len(keys)} tensors ({', '.join(keys[:3])}{', ...' * (len(keys) > 3)})"
        print(f"note: {named}: {note}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    report = _open(args).verify(args.step)
    bad = {s: {k: e for k, e in r.items() if e} for s, r in report.items()}
    bad = {s: r for s, r in bad.items() if r}
    if args.json:
        print(json.dumps({"ok": not bad, "steps": len(report), "failures": bad}, indent=1))
    else:
        for s, r in bad.items():
            for k, e in r.items():
                print(f"FAIL step {s} tensor {k}: {e}")
        tensors = sum(len(r) for r in report.values())
        damaged = sum(len(r) for r in bad.values())
        print(f"{'OK' if not bad else 'DAMAGED'}: {len(report)} step(s), {tensors} tensor(s) checked: "
              f"{tensors - damaged} intact, {damaged} damaged")
    return 1 if bad else 0


def cmd_gc(args: argparse.Namespace) -> int:
    from .usage import GRACE_SECONDS

    grace = GRACE_SECONDS if args.grace is None else args.grace
    report = _open(args, mode="a").gc(args.keep_last, args.keep_every, dry_run=args.dry_run, grace_seconds=grace)
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
        return 0
    verb = "would" if args.dry_run else "did"
    print(f"keep {len(report.keep)} step(s): {report.keep}")
    print(f"{verb} delete {len(report.delete)} step(s): {report.delete}")
    print(f"{verb} fold {len(report.rewrite)} kept step(s) off deleted ones: {report.rewrite}"
          + (f" ({_human(report.bytes_written)} written)" if not args.dry_run else ""))
    print(f"{verb} remove {len(report.orphans)} unreferenced object(s)")
    if report.uploads:
        print(f"{verb} abort {len(report.uploads)} upload(s) in parts never completed: {report.uploads}")
    if report.spared:
        print(f"spared {len(report.spared)} attempt(s) younger than --grace {grace:g} s, of steps newer than the "
              "latest: a save may still be writing them (once none runs, --grace 0 removes them)")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    report = _open(args, mode="a").delete(args.step, dry_run=args.dry_run)
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
        return 0
    verb = "would" if args.dry_run else "did"
    print(f"{verb} delete step {args.step}; {verb} fold {len(report.rewrite)} step(s) off it: {report.rewrite}")
    return 0


def cmd_pin(args: argparse.Namespace) -> int:
    store = _open(args, mode="a")
    if args.step is None:
        store.unpin(args.name)
    else:
        store.pin(args.step, args.name)
    return _print_pins(args, store.pins())


def cmd_pins(args: argparse.Namespace) -> int:
    return _print_pins(args, _sync(_history(args).pins()))


def _print_pins(args: argparse.Namespace, pins: dict[str, int]) -> int:
    if args.json:
        print(json.dumps(pins, indent=1))
    else:
        print("\n".join(f"{n}: {s}" for n, s in sorted(pins.items())) or "no pins")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    path = _open(args).export(args.step, args.out, format=args.format, subtree=args.subtree)
    print(json.dumps({"path": str(path)}) if args.json else f"wrote step {args.step} to {path}")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from .importer import import_checkpoint

    info = import_checkpoint(_open(args, mode="a"), args.step, args.input, format=args.format, subtree=args.subtree)
    if args.json:
        print(json.dumps({"step": info.step, "nbytes_raw": info.nbytes_raw, "nbytes_stored": info.nbytes_stored}))
    else:
        print(f"imported {args.input} as full step {info.step}: {_human(info.nbytes_stored)} stored")
    return 0


def cmd_du(args: argparse.Namespace) -> int:
    du = _sync(_usage(_history(args)).du())
    if args.json:
        print(json.dumps(du, indent=1))
        return 0
    print(f"total {_human(du['total'])} in {len(du['steps'])} step(s)")
    fp = du["storage"]
    dirs = f" and {fp['directories']} directories" if "directories" in fp else ""
    print(f"on storage: {fp['objects']} objects{dirs}, {_human(fp['bytes'])} "
          f"({_human(fp['allocated'])} allocated)")
    print("by group: " + ", ".join(f"{g} {_human(b)}" for g, b in sorted(du["groups"].items())))
    stray = du["uncommitted"]
    if stray["attempts"] or stray["uploads"]:
        print(_strays(args, stray))
    for step, b in du["steps"].items():
        print(f"{step:>10} {_human(b):>10}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run

    summary = run(args.uri, steps=args.steps, every=args.every, full_every=args.full_every, progress=_progress(args),
                  force=args.force)
    if args.json:
        print(json.dumps(summary, indent=1))
    return 0 if summary["verified"] and summary["resume_bit_identical"] else 1


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="amber-store",
        description="List, inspect, verify, garbage-collect, export and import amber-store checkpoints. URIs: a local path, "
                    "file://, memory://, s3://bucket/prefix, gs://bucket/prefix, az://container/prefix. Credentials and "
                    "endpoints come from each cloud's environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
                    "AWS_ENDPOINT_URL, AWS_REGION; application-default credentials, STORAGE_EMULATOR_HOST; "
                    "AZURE_STORAGE_CONNECTION_STRING, AZURE_STORAGE_ACCOUNT_NAME/_KEY) or the flags.",
    )
    sub = p.add_subparsers(dest="command", required=True)

    def add(name: str, help: str, uri: bool = True) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        if uri:
            sp.add_argument("uri", help="checkpoint store URI")
            sp.add_argument("--endpoint-url", help="the object store's endpoint, e.g. http://127.0.0.1:9000 for MinIO")
            sp.add_argument("--storage-option", action="append", metavar="KEY=VALUE",
                            help="fsspec storage option (repeatable)")
            sp.add_argument("--single-writer", action="store_true",
                            help="object stores: write even to a server that ignores conditional writes; "
                                 "only when nothing else writes the store meanwhile")
        sp.add_argument("--json", action="store_true", help="machine-readable output, no progress bars")
        return sp

    add("ls", "list committed steps with kind, base and bytes").set_defaults(func=cmd_ls)
    sp = add("info", "per-tensor table of one step")
    sp.add_argument("step", type=int, nargs="?", help="the step to describe (default: the latest)")
    sp.set_defaults(func=cmd_info)
    sp = add("verify", "read every chunk and check its checksum; exit 1 on any damage")
    sp.add_argument("step", type=int, nargs="?", help="the step to verify (default: every step)")
    sp.set_defaults(func=cmd_verify)
    sp = add("gc", "delete steps outside a retention policy, folding kept steps off them; remove orphans")
    sp.add_argument("--keep-last", type=int, help="keep the newest N steps (default: keep all, only sweep orphans)")
    sp.add_argument("--keep-every", type=int, help="also keep every step divisible by K")
    sp.add_argument("--dry-run", action="store_true", help="report what would happen, change nothing")
    sp.add_argument("--grace", type=float, metavar="SECONDS",
                    help="spare uncommitted data newer than the latest step younger than this (default: an hour)")
    sp.set_defaults(func=cmd_gc)
    sp = add("rm", "delete one step; steps that read its data are folded off it first")
    sp.add_argument("step", type=int, help="the committed step to delete")
    sp.add_argument("--dry-run", action="store_true", help="report what would happen, change nothing")
    sp.set_defaults(func=cmd_rm)
    sp = add("pin", "pin STEP under NAME so gc keeps it (no STEP: unpin NAME); prints the pins")
    sp.add_argument("name", help="the pin's name (letters, digits, '_', '.', '-')")
    sp.add_argument("step", type=int, nargs="?", help="the step to pin (none: remove the pin NAME)")
    sp.set_defaults(func=cmd_pin)
    add("pins", "list the pins (name: step)").set_defaults(func=cmd_pins)
    sp = add("export", "write a step as .safetensors (model tensors) or a torch.save file (.pt)")
    sp.add_argument("step", type=int, help="the committed step to export")
    sp.add_argument("out", help="the file to write (.safetensors, or .pt for torch.save)")
    sp.add_argument("--format", choices=["safetensors", "torch"], help="default: from OUT's suffix")
    sp.add_argument("--subtree", help="safetensors: the part of the state to export (default: model)")
    sp.set_defaults(func=cmd_export)
    sp = add("import", "save a torch.save or safetensors file, or a torch.distributed.checkpoint directory "
                       "(FileSystemWriter's; it stays loadable by dcp.load on any number of ranks), as a full step")
    sp.add_argument("step", type=int, help="the step to save it as (newer than the latest)")
    sp.add_argument("input", help="a .pt/.pth/.bin (torch.save), .safetensors file, or a DCP checkpoint directory")
    sp.add_argument("--format", choices=["safetensors", "torch"], help="a file's format (default: from INPUT's suffix)")
    sp.add_argument("--subtree", help="safetensors: put the tensors under this part of the state (default: the "
                                      "subtree the file was exported from, else the top level; '' for the top)")
    sp.set_defaults(func=cmd_import)
    add("du", "stored bytes by step and by top-level group (model, optim, ...)").set_defaults(func=cmd_du)
    sp = add("demo", "train a small GPT on CPU and checkpoint it two ways, the lossless default and the lossy "
                     "preset, side by side: bytes against torch.save, a historical step opened lazily, and a resume "
                     "from each (exit 1 unless the lossless one is bit-exact)", uri=False)
    sp.add_argument("--uri", default="./amber-demo",
                    help="where to checkpoint (default ./amber-demo; the lossy store goes beside it, URI-lossy); an "
                         "earlier demo's stores there are wiped first, any other store only with --force")
    sp.add_argument("--force", action="store_true", help="wipe the amber-store at --uri even if not the demo's")
    sp.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    sp.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    sp.add_argument("--full-every", type=int, default=10, help="a full step every N checkpoints")
    sp.set_defaults(func=cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (AmberError, PermissionError, ValueError, FileNotFoundError) as e:
        if getattr(args, "json", False):
            print(json.dumps({"error": str(e), "type": type(e).__name__}))
        else:
            print(f"amber-store: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`amber-store info ... | head`): no traceback, and none at exit
        # when Python flushes stdout again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    finally:
        while _OPENED:
            with contextlib.suppress(Exception):
                _OPENED.pop().close()


if __name__ == "__main__":
    sys.exit(main())
