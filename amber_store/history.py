"""The history of a store: committed steps, their manifests, commits and pins.

Everything that reads or writes steps goes through :class:`History`: the writer (the commit),
:mod:`~amber_store.chains` (what a step's tensors diff against and read, from its manifests),
the reader, retention (manifest replacement, uncommits), export, the DCP adapters and
:mod:`~amber_store.usage` (what a store holds). It holds no tensors.
"""

from __future__ import annotations

import asyncio
import json
import numbers
import re
import time
import uuid
from collections import OrderedDict
from typing import Any

import crc32c

from . import format as fmt
from . import shards, validation
from .errors import (ConcurrentWriterError, CorruptDataError, FormatVersionError, NotAnAmberStoreError, PinNotFoundError,
                     StepNotFoundError, StepOrderError, StorageAccessError)
from .format import Manifest, TensorEntry
from .runtime import REQUESTS_AT_ONCE, gather
from .storage import Backend, storage_errors

PINS_DIR = "pins"

def json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


#: parsed manifests kept (the most recently used), at least; and at least twice the longest
#: chain seen, so that walking a chain never evicts its own steps. Keeping them all grew a
#: long run's memory without bound: a 2,000-tensor step's manifest is ~10,000 objects and 2-4
#: MB, and every full garbage collection walks them (60 steps: 78 -> 177 ms, in the middle of
#: save_async's stall when one strikes there).
MANIFEST_CACHE = 32


#: an attempt group's name under ``steps/``: the step, then the attempt
GROUP_NAME = re.compile(r"(\d{12})-[0-9a-f]+")
#: how old a claim (:meth:`History._claim`) whose step is not committed must be before later
#: writers take it for that of a writer that died committing: its manifest follows the claim at
#: once, within the backend's ``put_timeout``
CLAIM_GRACE_SECONDS = 180.0
#: claims of one parent step tried before a commit gives up
MAX_CLAIMS = 100
#: a claim's name under ``claims/``: its parent step (or ``start``), then its number
CLAIM_NAME = re.compile(r"(\d{12}|start)-\d+\.json")
class History:
    """Committed steps of one store, read through a manifest cache (:data:`MANIFEST_CACHE`).

    Concurrent requests for one manifest share a single read and parse.
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.writer_id = uuid.uuid4().hex[:12]
        self.last_commit: int | None = None
        #: a manifest whose create was sent and whose answer never came (:meth:`settle`)
        self.unsettled: Manifest | None = None
        self._manifests: OrderedDict[int, asyncio.Future[Manifest]] = OrderedDict()
        self._cache_size = MANIFEST_CACHE
        #: per cached manifest with fragments (by id): its map, and each fragment's read
        self._fragments: dict[int, tuple[shards.FragmentMap, dict[int, asyncio.Future[None]]]] = {}

    @property
    def uri(self) -> str:
        return self.backend.uri

    # --- root -----------------------------------------------------------------------------

    async def root_version(self) -> int | None:
        """The root's format version, ``None`` for an empty location; refuses foreign data."""
        raw = await self.backend.get("zarr.json")
        if raw is None:
            return None
        attrs = json.loads(raw.tobytes()).get("attributes", {}).get(fmt.ROOT_ATTR)
        if not isinstance(attrs, dict) or attrs.get("format") != fmt.FORMAT_NAME:
            raise NotAnAmberStoreError(f"{self.uri}: holds a zarr hierarchy that is not an amber-store")
        version = attrs.get("format_version")
        self.check_version(version)
        return int(version)

    async def require_root(self) -> int:
        """The root's format version; refuses an empty location (nothing to read)."""
        version = await self.root_version()
        if version is None:
            raise NotAnAmberStoreError(f"{self.uri}: no amber-store here ({await self._what_is_here()})")
        return version

    async def _what_is_here(self) -> str:
        """What a location that is not a store holds, and what to do with checkpoint files."""
        names = []
        async for name in self.backend.list_dir(""):
            names.append(name)
            if len(names) == 1000:
                break
        if not names:
            return "nothing to read"
        if ".metadata" in names:
            return ("it is a torch.distributed.checkpoint directory: move it into a store with "
                    "`amber-store import STORE STEP DIR`")
        files = sorted(n for n in names if n.lower().endswith(_CHECKPOINT_SUFFIXES))
        if files:
            shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
            return f"it holds checkpoint files ({shown}): save one into a store with `amber-store import STORE STEP FILE`"
        return "it holds other data"

    async def write_root(self) -> None:
        """The root group (format version: this code's) and the ``steps`` group below it, so
        stock zarr can walk from the root to every step."""
        root = {"format": fmt.FORMAT_NAME, "format_version": fmt.FORMAT_VERSION}
        await self.backend.put_object("zarr.json", [json_bytes(fmt.group_metadata({fmt.ROOT_ATTR: root}))])
        await self.backend.put_object(f"{fmt.STEPS_DIR}/zarr.json", [json_bytes(fmt.group_metadata())])

    async def initialize(self, mode: str, exclusive_commits: bool) -> int | None:
        """Open the store in ``mode`` (``"r"``, ``"a"`` or ``"w"``: wipe what is there): its
        root's format version, ``None`` where no store is yet (a writable open creates nothing:
        the first save does, :meth:`create`, so a mistyped path leaves nothing behind). Refuses
        a location holding other data. With ``exclusive_commits``, an existing store's backend
        must keep two writers from both committing one step
        (:meth:`Backend.require_conditional_writes`)."""
        if mode == "r":
            return await self.require_root()
        version = await self.root_version()
        if version is not None and mode == "w":  # only ever wipe what is recognisably ours
            await self.backend.delete_dir("")
            version = None
        if version is None:
            if not await self.backend.is_empty():
                raise NotAnAmberStoreError(f"{self.uri}: not empty and not an amber-store ({await self._what_is_here()}); "
                                           "refusing to write into it")
            return None
        if exclusive_commits:
            # Only once the store holds its root: some servers (SeaweedFS) leave an empty
            # folder marker behind the deleted probe object.
            await self.backend.require_conditional_writes()
        return version

    async def create(self, exclusive_commits: bool) -> int:
        """Make the store exist (its first save): the root, then the conditional-write check
        :meth:`initialize` left for this moment. Returns the format version written."""
        await self.write_root()
        if exclusive_commits:
            await self.backend.require_conditional_writes()
        return fmt.FORMAT_VERSION

    def close(self) -> None:
        """Drop cached manifests and close the storage client's connections (a later request
        connects again)."""
        self.forget()
        self.backend.close()

    def check_version(self, version: Any) -> None:
        if not isinstance(version, int) or version > fmt.FORMAT_VERSION:
            raise FormatVersionError(
                f"{self.uri}: written with format version {version}; this amber-store reads "
                f"up to {fmt.FORMAT_VERSION}; upgrade amber-store"
            )

    # --- steps and manifests ------------------------------------------------------------

    async def steps(self) -> list[int]:
        with storage_errors(self.uri, "listing the committed steps"):
            names = [n async for n in self.backend.list_dir(fmt.COMMITS_DIR)]
        return sorted(s for s in map(fmt.parse_commit_key, names) if s is not None)

    async def manifest(self, step: int) -> Manifest:
        """The manifest of ``step``, with every entry (all of a sharded step's fragments read)."""
        m = await self.index(step)
        if m.fragments is not None:
            await gather(self._fragment(m, f) for f, info in enumerate(m.fragments) if info is not None)
        return m

    async def index(self, step: int) -> Manifest:
        """The manifest of ``step`` as committed: a sharded step's holds only the entries of the
        fragments read so far (:meth:`entry` reads the one it needs)."""
        if not isinstance(step, numbers.Integral) or isinstance(step, bool) or step < 0:
            # (a step from a command line or a config file, say "50")
            raise StepNotFoundError(f"{self.uri}: {step!r} is not a step: steps are non-negative ints"
                                    + (f" (int({step!r}) is {int(step)})" if isinstance(step, str) and step.isdigit() else ""))
        step = int(step)
        fut = self._manifests.get(step)
        if fut is not None and fut.done() and not fut.cancelled() and fut.exception() is None:
            self._manifests.move_to_end(step)
            return fut.result()  # (without a shield: a save asks once per tensor)
        if fut is None or fut.done():  # not read yet, or the read failed: read again
            fut = asyncio.ensure_future(self._read_manifest(step))
            self._cache(step, fut)
        try:
            return await asyncio.shield(fut)
        except StepNotFoundError:
            self._manifests.pop(step, None)
            raise

    async def entry(self, step: int, key: str) -> TensorEntry | None:
        """``key``'s entry in ``step`` (``None``: the step has no such tensor), reading only the
        fragment that holds it."""
        m = await self.index(step)
        e = m.tensors.get(key)
        if e is not None or m.fragments is None:
            return e
        f = self._map(m).fragment(key)
        if f is None:
            return None
        await self._fragment(m, f)
        return m.tensors.get(key)

    async def entries(self, step: int, keys: list[str]) -> dict[str, TensorEntry]:
        """The entries of ``keys`` in ``step`` (each must be there), reading each fragment they
        lie in once."""
        m = await self.index(step)
        if m.fragments is not None:
            fmap = self._map(m)
            await gather(self._fragment(m, f) for f in {fmap.fragment(k) for k in keys if k not in m.tensors}
                         if f is not None)
        missing = [k for k in keys if k not in m.tensors]
        if missing:
            raise KeyError(f"step {step} has no item {missing[0]!r}")
        return {k: m.tensors[k] for k in keys}

    def _map(self, m: Manifest) -> shards.FragmentMap:
        held = self._fragments.get(id(m))
        if held is None or held[0].manifest is not m:
            held = self._fragments[id(m)] = (shards.FragmentMap(m), {})
        return held[0]

    async def _fragment(self, m: Manifest, f: int) -> None:
        """Read fragment ``f`` of ``m`` into its entries and packs (once)."""
        fmap = self._map(m)
        reads = self._fragments[id(m)][1]
        fut = reads.get(f)
        if fut is None or (fut.done() and (fut.cancelled() or fut.exception() is not None)):
            fut = reads[f] = asyncio.ensure_future(self._read_fragment(m, fmap, f))
        await asyncio.shield(fut)

    async def _read_fragment(self, m: Manifest, fmap: shards.FragmentMap, f: int) -> None:
        assert m.fragments is not None
        info = m.fragments[f]
        if info is None:
            raise CorruptDataError(f"{self.uri}: step {m.step}: fragment {f} is named but was never written",
                                   step=m.step)
        with storage_errors(self.uri, f"reading fragment {f} of step {m.step}"):
            raw = await self.backend.get(info["key"])
        where = f"{self.uri}: step {m.step}: fragment {info['key']}"
        if raw is None:
            raise CorruptDataError(f"{where} is missing", step=m.step)
        data = raw.tobytes()
        if len(data) != info["nbytes"] or crc32c.crc32c(data) != info["crc32c"]:
            raise CorruptDataError(f"{where} is damaged ({len(data)} bytes, checksum differs from the index's)",
                                   step=m.step)
        try:
            entries, packs = fmt.fragments.decode(data, fmap.items(f), m.group, m.step,
                                                  max_chunk=validation.MAX_CHUNK_BYTES, known=validation.known_encoding)
            for name, pack in packs.items():
                validation.check_pack(name, pack)
                validation.check_key(pack["array"], f"{m.group}/")
        except (fmt.fragments.Invalid, validation.Invalid) as e:
            raise CorruptDataError(f"{where} is unreadable: {e}", step=m.step) from None
        same = [(key, e) for key, e in entries.items() if e.encoding == "same"]
        bases = await gather(self.entry(e.base, key) for key, e in same)  # (each an earlier step: no cycle)
        for (key, e), b in zip(same, bases):
            if b is None or b.encoding == "same" or (b.shape, b.dtype, b.chunks) != (e.shape, e.dtype, e.chunks):
                raise CorruptDataError.at(self.uri, m.step, key, f"its base step {e.base} holds no such tensor")
            e.crc32c = b.crc32c
        m.packs.update(packs)
        m.tensors.update(entries)

    async def _read_manifest(self, step: int) -> Manifest:
        with storage_errors(self.uri, f"reading the manifest of step {step}"):
            raw = await self.backend.get(fmt.commit_key(step))
        if raw is None:
            known = await self.steps()
            hint = f"committed steps: {known[:5]}{'...' if len(known) > 5 else ''}" if known else "the store is empty"
            raise StepNotFoundError(f"{self.uri}: step {step} is not committed ({hint})")
        m = self._parse(step, raw.tobytes())
        self._fit_cache(m)
        return m

    def _parse(self, step: int, data: bytes) -> Manifest:
        """The manifest of ``step`` in ``data``, checked before use (:mod:`amber_store.validation`)."""
        try:
            m = validation.parse_manifest(data)
        except FormatVersionError as e:
            raise FormatVersionError(f"{self.uri}: step {step} {e}") from None
        except validation.Invalid as e:  # an empty, truncated or crafted commit object
            raise validation.corrupt(self.uri, step, fmt.commit_key(step), data, e) from None
        if m.step != step:
            raise validation.corrupt(self.uri, step, fmt.commit_key(step), data,
                                     validation.Invalid(f"it names step {m.step}"))
        return m

    def remember(self, manifest: Manifest) -> None:
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(manifest)
        self._fit_cache(manifest)
        self._cache(manifest.step, fut)

    def _fit_cache(self, m: Manifest) -> None:
        # a chain reaches back at most to its segment's full step (``depth`` in formats without segments)
        self._cache_size = max(self._cache_size, 2 * (max(len(m.segment), m.depth) + 1))

    def _cache(self, step: int, fut: asyncio.Future[Manifest]) -> None:
        self._manifests[step] = fut
        self._manifests.move_to_end(step)
        while len(self._manifests) > self._cache_size:
            _, old = self._manifests.popitem(last=False)  # (a read in flight goes on for whoever awaits it)
            if old.done() and not old.cancelled() and old.exception() is None:
                self._fragments.pop(id(old.result()), None)

    def forget(self) -> None:
        """Drop cached manifests (after retention rewrote or removed some)."""
        self._manifests.clear()
        self._fragments.clear()

    async def outdated(self, step: int) -> bool:
        """Whether ``step`` as read before is no longer what is committed: retention (of this
        process or another) removed it, or rewrote it onto other bases (its manifest held
        here, if any, differs from the committed one)."""
        fut = self._manifests.get(step)
        held = fut.result() if fut is not None and fut.done() and not fut.cancelled() and fut.exception() is None else None
        try:
            fresh = await self._read_manifest(step)
        except StepNotFoundError:
            return True
        return held is not None and fresh.to_json() != held.to_json()

    # --- commits ------------------------------------------------------------------------

    async def commit(self, manifest: Manifest, latest: int | None) -> None:
        """Create the manifest exclusively: the commit point. ``latest`` is the newest step the
        writer saw when it began; a newer one now means another writer interleaved. On an object
        store the commit gives up after the backend's ``put_timeout``, its outcome unknown."""
        try:
            await self.backend.bounded(self._create(manifest, latest))
        except (TimeoutError, asyncio.TimeoutError) as e:
            raise StorageAccessError(
                f"{self.uri}: the commit of step {manifest.step} got no answer in time: it may or may not "
                "have landed (then the step is there, complete, and this writer's next save "
                "adopts it); earlier steps are untouched"
            ) from e
        self.remember(manifest)
        self.last_commit = manifest.step

    async def _create(self, manifest: Manifest, latest: int | None) -> None:
        now = (await self.steps() or [None])[-1]
        if now != latest and not (now is not None and await self._adopt(now, latest)):
            raise ConcurrentWriterError(
                f"{self.uri}: step {now} was committed by another writer while step "
                f"{manifest.step} was being saved; this save was not committed"
            )
        if now is not None and now >= manifest.step:
            raise StepOrderError(
                f"{self.uri}: step {now}, whose commit by this writer had got no answer in time, landed "
                f"while step {manifest.step} was being saved; step {manifest.step} is not newer and was not committed"
            )
        await self._claim(manifest, now)
        key = fmt.commit_key(manifest.step)
        self.unsettled = manifest  # (until the create's outcome is known)
        created = await self.backend.put_if_absent(key, manifest.encode())
        ours = created or await self._is_ours(key, manifest)
        self.unsettled = None
        if not ours:
            raise ConcurrentWriterError(
                f"{self.uri}: another writer committed step {manifest.step} first; this save "
                f"(attempt {manifest.attempt}) was not committed and its data is orphaned"
            )

    async def settle(self) -> bool:
        """Learn the outcome of a commit whose answer never came, by sending its create again:
        the step is then committed (by that request or this one), or another writer's manifest
        holds its key. Either way the first request, should it land late (a server that was
        frozen, then thawed), can no longer create anything, so no later gc can delete the data
        of a step that lands afterwards. Whether it is committed by this writer (call it only
        with :attr:`unsettled` set)."""
        manifest = self.unsettled
        assert manifest is not None
        key = fmt.commit_key(manifest.step)
        with storage_errors(self.uri, f"settling the commit of step {manifest.step}, whose answer never came"):
            ours = await self.backend.bounded(self.backend.put_if_absent(key, manifest.encode())) or \
                await self._is_ours(key, manifest)
        self.unsettled = None
        if ours:
            self.remember(manifest)
            self.last_commit = max(manifest.step, self.last_commit if self.last_commit is not None else -1)
        return ours

    async def _claim(self, manifest: Manifest, parent: int | None) -> None:
        """Claim ``parent`` (the newest committed step, ``None`` in an empty store) as the step
        ``manifest`` builds on, by an exclusive create: of two writers that both listed the same
        latest step, exactly one commits; the other's commit raises
        :class:`ConcurrentWriterError`. A claim whose step never landed (its writer died between
        the claim and the manifest, or its step was deleted since) is passed over, to the next
        claim of that parent; so is one of this writer's own."""
        mine = {"step": manifest.step, "attempt": manifest.attempt, "writer": manifest.writer,
                "group": manifest.group, "time": time.time()}
        for n in range(MAX_CLAIMS):
            key = fmt.claim_key(parent, n)
            if await self.backend.put_if_absent(key, json_bytes(mine)):
                return
            raw = await self.backend.get(key)
            other = _claim_of(raw.tobytes()) if raw is not None else None
            if other is None or other["attempt"] == manifest.attempt:
                return  # (our own, its answer lost and the request retried; or unreadable: the commit decides)
            # (this writer's own earlier claim: a commit that failed or lost its answer; one
            # writer saves one step at a time, so it is no rival)
            if other["writer"] != manifest.writer and not await self._dead(other):
                raise ConcurrentWriterError(
                    f"{self.uri}: step {other['step']} (writer {other['writer']}) was saved on step {parent} "
                    f"while step {manifest.step} was: two jobs are writing one store; step {manifest.step} was not "
                    "committed")
        raise ConcurrentWriterError(f"{self.uri}: {MAX_CLAIMS} abandoned commits of steps after step {parent}: "
                                    "too many writers died committing; this save was not committed")

    async def spent_claims(self) -> list[str]:
        """Keys of claims no commit will consult again: of a parent older than the latest step
        (or of an empty store's start, once it has steps), made more than
        :data:`CLAIM_GRACE_SECONDS` ago (a writer that listed before the latest step landed has
        committed or failed by then). Unreadable ones go too."""
        steps = await self.steps()
        if not steps:
            return []
        keys = []
        async for name in self.backend.list_dir(fmt.CLAIMS_DIR):
            found = CLAIM_NAME.fullmatch(name)
            if found is not None and (found.group(1) == "start" or int(found.group(1)) < steps[-1]):
                keys.append(f"{fmt.CLAIMS_DIR}/{name}")
        spent = []
        raws = await gather((self.backend.get(k) for k in keys), limit=REQUESTS_AT_ONCE)
        for key, raw in zip(keys, raws):
            claim = _claim_of(raw.tobytes()) if raw is not None else None
            if raw is not None and (claim is None or time.time() - claim["time"] > CLAIM_GRACE_SECONDS):
                spent.append(key)
        return sorted(spent)

    async def _dead(self, claim: dict[str, Any]) -> bool:
        """Whether a claim's commit never landed and never will: its step is not committed, and its
        attempt is gone (deleted) or the claim is older than :data:`CLAIM_GRACE_SECONDS`."""
        if await self.backend.exists(fmt.commit_key(claim["step"])):
            return False
        return await self.created(claim["group"]) is None or time.time() - claim["time"] > CLAIM_GRACE_SECONDS

    async def _is_ours(self, key: str, manifest: Manifest) -> bool:
        """Whether an existing commit object is this very attempt (a retried request that had
        in fact succeeded before its connection failed)."""
        raw = await self.backend.get(key)
        return raw is not None and self._parse(manifest.step, raw.tobytes()).attempt == manifest.attempt

    async def check_sole_writer(self, latest: int | None) -> None:
        """Refuse to save once another writer has committed after this one.

        A writer that has not committed yet may continue any run (a resumed job); once it has,
        the newest step must stay its own, or two jobs are interleaving one history. A newer
        step of this very writer is a commit whose answer was lost (the server crashed or the
        connection dropped after storing it): it is adopted.
        """
        if self.last_commit is not None and latest != self.last_commit and not await self._adopt(latest, self.last_commit):
            other = (await self.manifest(latest)).writer if latest is not None else "?"
            raise ConcurrentWriterError(
                f"{self.uri}: step {latest} was committed by another writer ({other}) after this "
                f"writer's ({self.writer_id}) step {self.last_commit}; two jobs are writing one store"
            )

    async def _adopt(self, step: int | None, after: int | None) -> bool:
        """Whether ``step``, newer than ``after``, is a commit of this very writer whose answer
        was lost or came too late (it may land while the next save runs); if so it becomes the
        writer's last commit. One writer saves one step at a time, so no other case makes it."""
        if step is None or (after is not None and step <= after) or (await self.manifest(step)).writer != self.writer_id:
            return False
        self.last_commit = step
        return True

    async def replace(self, manifest: Manifest) -> None:
        """Atomically replace a committed step's manifest (retention's fold)."""
        await self.backend.put(fmt.commit_key(manifest.step), manifest.encode())
        self.remember(manifest)

    async def uncommit(self, step: int) -> None:
        await self.backend.delete(fmt.commit_key(step))
        self._manifests.pop(step, None)

    async def created(self, group: str) -> float | bool | None:
        """When an attempt group was created, from its zarr.json: ``None`` without one,
        ``False`` with one that names no time."""
        raw = await self.backend.get(f"{group}/zarr.json")
        if raw is None:
            return None
        created = json.loads(raw.tobytes()).get("attributes", {}).get(fmt.ROOT_ATTR, {}).get("created")
        return float(created) if isinstance(created, (int, float)) else False

    # --- pins ---------------------------------------------------------------------------

    async def pins(self) -> dict[str, int]:
        out = {}
        async for name in self.backend.list_dir(PINS_DIR):
            if name.endswith(".json"):
                raw = await self.backend.get(f"{PINS_DIR}/{name}")
                if raw is not None:
                    out[name[: -len(".json")]] = int(json.loads(raw.tobytes())["step"])
        return out

    async def pin(self, step: int, name: str) -> None:
        await self.manifest(step)
        await self.backend.put(pin_key(name), json.dumps({"step": step}).encode())

    async def unpin(self, name: str) -> None:
        key = pin_key(name)
        if not await self.backend.exists(key):
            pins = await self.pins()
            raise PinNotFoundError(f"{self.uri}: no pin named {name!r} (pins: {', '.join(sorted(pins)) or 'none'})")
        await self.backend.delete(key)


_CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors")


def _claim_of(data: bytes) -> dict[str, Any] | None:
    """A claim object's fields, checked (another writer's: untrusted); ``None`` if unreadable."""
    try:
        claim = json.loads(data)
        validation.check_key(claim["group"], f"{fmt.STEPS_DIR}/")
        ok = (isinstance(claim["step"], int) and isinstance(claim["attempt"], str) and isinstance(claim["time"], (int, float))
              and isinstance(claim["writer"], str))
    except (ValueError, KeyError, TypeError):
        return None
    return claim if ok else None


def pin_key(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,128}", name):
        raise ValueError(f"pin name {name!r}: use letters, digits, '_', '.', '-' (at most 128)")
    return f"{PINS_DIR}/{name}.json"

