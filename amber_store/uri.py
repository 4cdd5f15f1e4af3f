"""URI -> zarr store, the way fsspec resolves URLs to filesystems.

``/path`` or ``file:///path``: :class:`zarr.storage.LocalStore` (NVMe), reading large objects
by mapping them (:class:`MappedLocalStore`). ``memory://name``: a
:class:`zarr.storage.MemoryStore` shared by every open of the same name in this process.
``s3://bucket/prefix``: zarr's FsspecStore on s3fs, reading a whole object with one GET
(:class:`S3ObjectStore`). Any other scheme is refused before any I/O. :func:`probe` checks reachability at ``open`` time so that a
wrong URI, bucket or credential fails there, with a message that names the URI and never the
secrets; :func:`require_conditional_writes` checks that an S3 server can make a commit exclusive.

Every S3 request is bounded (:data:`S3_TIMEOUTS`): a hung server fails a request instead of
hanging it, and the store's connections are closed at exit even if nobody calls ``close``.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import functools
import hashlib
import mmap
import os
import threading
import uuid
import weakref
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit

import numpy as np
from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, Store, SuffixByteRequest
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype
from zarr.core.sync import sync
from zarr.storage import FsspecStore, LocalStore, MemoryStore

from .errors import AmberError, InvalidURIError, NotAnAmberStoreError, StorageAccessError, UnsafeStorageError

SUPPORTED = "a local path, file://, memory:// or s3:// (s3a://)"
_MEMORY: dict[str, dict[str, Buffer]] = {}
_MEMORY_LOCK = threading.Lock()

#: Defaults for every S3 request (botocore ``Config`` keys; ``storage_options["config_kwargs"]``
#: overrides them). A read from a server that stops answering fails after its attempts
#: (``S3_RETRIES`` x ``max_attempts`` x ``read_timeout`` plus back-off: ~130 s measured) instead
#: of never; a save has its own, overall deadline on top (``Store(save_timeout=...)``).
#: ``read_timeout`` bounds the silence between bytes, not a whole transfer.
S3_TIMEOUTS: dict[str, Any] = {"connect_timeout": 5, "read_timeout": 15,
                               "retries": {"max_attempts": 3, "mode": "standard"}}
#: s3fs's own attempts at a request that timed out or lost its connection, around botocore's.
S3_RETRIES = 2
#: Bound on a commit (its listing and conditional PUT) and on other metadata PUTs outside a
#: save's deadline (pins, retention's folds): small requests, which would otherwise wait out
#: every attempt's read timeout (~130 s for a listing, measured on SeaweedFS stopped by SIGSTOP).
S3_PUT_TIMEOUT = 60.0

# Whether each S3 endpoint enforces If-None-Match (checked once per process).
_CONDITIONAL: dict[str, bool] = {}


#: Local objects at least this large are read by mapping them (smaller ones: a read is cheaper).
MAP_MIN_BYTES = 1 << 20


def _get_local(path: Path, prototype: BufferPrototype, byte_range: ByteRequest | None) -> Buffer:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if isinstance(byte_range, RangeByteRequest):
            start, stop = byte_range.start, min(size, byte_range.end)
        elif isinstance(byte_range, OffsetByteRequest):
            start, stop = byte_range.offset, size
        elif isinstance(byte_range, SuffixByteRequest):
            start, stop = max(0, size - byte_range.suffix), size
        elif byte_range is None:
            start, stop = 0, size
        else:
            raise TypeError(f"unexpected byte range {byte_range!r}")
        start = min(start, stop)
        if size < MAP_MIN_BYTES or os.name != "posix":
            f.seek(start)
            return prototype.buffer.from_bytes(f.read(stop - start))
        whole = np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), dtype=np.uint8)
    return prototype.buffer.from_array_like(whole[start:stop])


class MappedLocalStore(LocalStore):
    """zarr's :class:`~zarr.storage.LocalStore`, reading large objects by mapping their files:
    a read then neither copies from the page cache nor faults in fresh memory (measured: a
    whole-step read of 1.5 GB of shard objects, 0.85 s copied vs 0.12 s mapped and
    checksummed). Safe because amber-store never rewrites a file in place: every object is
    written aside and renamed over (zarr's writes, :func:`put_object`), so a mapping keeps the
    bytes it was opened on, even after the file is deleted."""

    async def get(self, key: str, prototype: BufferPrototype | None = None,
                  byte_range: ByteRequest | None = None) -> Buffer | None:
        if not self._is_open:
            await self._open()
        try:
            return await asyncio.to_thread(_get_local, self.root / key, prototype or default_buffer_prototype(),
                                           byte_range)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None


class S3ObjectStore(FsspecStore):
    """zarr's :class:`~zarr.storage.FsspecStore`, reading a whole object with one GET. s3fs asks
    for an object's size (a HEAD) before each whole read, to split a big one into concurrent
    range reads: that doubled the requests of a load and took a quarter of its event loop
    (measured on SeaweedFS). amber-store's readers range-read big objects chunk by chunk
    themselves (:data:`amber_store.reader.WHOLE_OBJECT_BYTES`)."""

    async def get(self, key: str, prototype: BufferPrototype | None = None,
                  byte_range: ByteRequest | None = None) -> Buffer | None:
        prototype = prototype or default_buffer_prototype()
        if byte_range is not None:
            return await super().get(key, prototype, byte_range)
        if not self._is_open:
            await self._open()
        try:
            data = await self.fs._cat_file(f"{self.path.rstrip('/')}/{key}", max_concurrency=1)
        except self.allowed_exceptions:
            return None
        return prototype.buffer.from_bytes(data)


@dataclass(frozen=True)
class Location:
    """A resolved URI: the zarr store plus what error messages may show of it."""

    store: Store
    uri: str
    scheme: str
    fs: Any = None
    path: str = ""

    @property
    def endpoint(self) -> str:
        """The server behind an S3 location, as messages name it."""
        return (getattr(self.fs, "client_kwargs", None) or {}).get("endpoint_url") or "AWS S3"

    def close(self) -> None:
        """Close the storage client's connections. The location stays usable: a new client,
        with no connection yet, takes the old one's place (and is closed in turn when the
        filesystem goes, or at exit)."""
        if _close_fs(self.fs):
            sync(_renew_client(self.fs))


# S3 filesystems with a client session, and the event loop (zarr's) the session lives on;
# closed at exit. This hook is registered after zarr's (amber_store imports zarr first), so it
# runs while that loop still runs.
_SESSIONS: "weakref.WeakKeyDictionary[Any, asyncio.AbstractEventLoop]" = weakref.WeakKeyDictionary()


@atexit.register
def _close_sessions() -> None:
    for fs in list(_SESSIONS):
        _close_fs(fs)


def _close_fs(fs: Any) -> bool:
    """Close the client of ``fs`` if it is one of ours; whether it was."""
    client = getattr(fs, "_s3", None)
    if client is None or fs not in _SESSIONS:
        return False
    fs._s3 = None
    _close_client(client, _SESSIONS[fs])
    return True


def _track_client(fs: Any) -> None:
    """Close the client of ``fs`` when the filesystem goes, or at exit: aiohttp warns about
    every session still open then. Called on the event loop the client lives on."""
    loop = asyncio.get_running_loop()
    weakref.finalize(fs, _close_client, fs._s3, loop).atexit = False
    _SESSIONS[fs] = loop


async def _renew_client(fs: Any) -> None:
    await fs.set_session()
    _track_client(fs)


def _close_client(client: Any, loop: asyncio.AbstractEventLoop) -> None:
    """Close an aiobotocore client on its event loop; from that loop's own thread (a finalizer
    run by the garbage collector there) schedule it instead of waiting on itself."""
    if loop.is_closed() or not loop.is_running():
        return
    fut = asyncio.run_coroutine_threadsafe(client.close(), loop)
    with suppress(RuntimeError):
        if asyncio.get_running_loop() is loop:
            return
    with suppress(Exception):
        fut.result(timeout=10)


def _s3_options(storage_options: dict[str, Any]) -> dict[str, Any]:
    """s3fs options with the standard AWS environment honoured and object-store-safe defaults."""
    opts = dict(storage_options)
    endpoint = opts.pop("endpoint_url", None) or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get(
        "AWS_ENDPOINT_URL"
    )
    client_kwargs = dict(opts.pop("client_kwargs", {}) or {})
    if endpoint:
        client_kwargs.setdefault("endpoint_url", endpoint)
    if urlsplit(client_kwargs.get("endpoint_url") or "").scheme.lower() == "http":
        # No TLS to verify: botocore would still load the CA bundle into an SSL context for
        # each client (40 ms of a 70 ms open and first read, measured on SeaweedFS).
        client_kwargs.setdefault("verify", False)
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        client_kwargs.setdefault("region_name", region)
    opts["client_kwargs"] = client_kwargs
    config_kwargs = {**S3_TIMEOUTS, **(opts.pop("config_kwargs", {}) or {})}
    if endpoint:
        # MinIO and other S3-compatible servers want path-style addressing.
        config_kwargs.setdefault("s3", {"addressing_style": "path"})
    # botocore >= 1.36 adds checksums that several S3-compatible stores reject.
    config_kwargs.setdefault("request_checksum_calculation", "when_required")
    config_kwargs.setdefault("response_checksum_validation", "when_required")
    opts["config_kwargs"] = config_kwargs
    # Steps are discovered by listing; a cached listing would hide new commits.
    opts.setdefault("use_listings_cache", False)
    # s3fs caches filesystems by their arguments, not by the environment: a cached one would
    # keep the credentials (or their absence) of an earlier open.
    opts.setdefault("skip_instance_cache", True)
    if "session" not in opts:
        opts["session"] = _session(opts.get("profile"))
    _no_expect_continue(opts["session"])
    return opts


def _no_expect_continue(session: Any) -> None:
    """Make the clients of ``session`` send a PUT's body at once. botocore asks for
    "Expect: 100-continue" on every PUT, and aiohttp waits for that interim answer with no
    timeout: a PUT to a hung server waited 400 s and more (GETs fail after their read
    timeouts), and once abandoned SeaweedFS stored an empty object. Without it
    ``read_timeout`` bounds the wait. Done on the session, not a client, so that the client
    made again after :meth:`Location.close` sends no such header either."""
    from botocore.handlers import add_expect_header

    session.unregister("before-call.s3", add_expect_header)


def _session(profile: str | None) -> Any:
    """A new botocore session (credentials and configuration read afresh) that shares one
    loader of botocore's service models with every other: parsing them took 0.13-0.34 s of
    each S3 open, 0.01 s once loaded (measured on SeaweedFS)."""
    from aiobotocore.session import AioSession

    session = AioSession(profile=profile)
    session.register_component("data_loader", _models(session.get_config_variable("data_path")))
    return session


@functools.cache
def _models(data_path: str | None) -> Any:
    from botocore.loaders import create_loader

    return create_loader(data_path)


def resolve(uri: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, *, read_only: bool = False) -> Location:
    """Resolve ``uri`` to a zarr store (no I/O; see :func:`probe`)."""
    storage_options = dict(storage_options or {})
    text = os.fspath(uri)
    if not text:
        raise InvalidURIError("empty checkpoint URI")
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt"):
        if storage_options:
            raise InvalidURIError(f"{text}: storage_options are not used by local paths")
        path = Path(parts.path if scheme == "file" else text).expanduser().absolute()
        if path.exists() and not path.is_dir():
            raise InvalidURIError(f"{text}: exists and is not a directory")
        return Location(MappedLocalStore(path, read_only=read_only), str(path), "file", path=str(path))
    if scheme == "memory":
        name = (parts.netloc + parts.path).strip("/")
        with _MEMORY_LOCK:
            data = _MEMORY.setdefault(name, {})
        return Location(MemoryStore(data, read_only=read_only), f"memory://{name}", "memory", path=name)
    if scheme in ("s3", "s3a"):
        if not parts.netloc:
            raise InvalidURIError(f"{text}: an s3 URI needs a bucket: s3://bucket/prefix")
        storage_options = _s3_options(storage_options)
        text = f"s3://{parts.netloc}{parts.path}".rstrip("/")
        scheme = "s3"
    else:
        raise InvalidURIError(f"{text}: unsupported URI scheme {scheme!r}; use {SUPPORTED}")
    try:
        store = S3ObjectStore.from_url(text, storage_options=storage_options, read_only=read_only)
    except (TypeError, ValueError, ImportError) as e:
        raise InvalidURIError(f"{text}: cannot create a {scheme} filesystem: {e}") from None
    if scheme == "s3":
        store.fs.retries = S3_RETRIES  # a class attribute of s3fs (5), not a constructor option
    return Location(store, text, scheme, fs=store.fs, path=store.path)


def connect(uri: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, *,
            read_only: bool = False) -> Location:
    """Resolve ``uri`` and check now that its storage can be used (:func:`probe`)."""
    loc = resolve(uri, storage_options, read_only=read_only)
    sync(probe(loc))
    return loc


async def put_if_absent(loc: Location, key: str, data: bytes) -> bool:
    """Create ``key`` holding ``data`` only if it does not exist; ``False`` if it did.

    Atomic where the backend allows: a local file is written aside and hard-linked into place
    (link fails if the name exists, and readers never see a partial file); S3 uses a
    conditional PUT (``If-None-Match: *``), which AWS S3, MinIO and SeaweedFS honour: a 412
    answer means it existed, whatever the error body says. Other
    backends fall back to zarr's check-then-set, which two racing writers can both pass.
    """
    if loc.scheme == "file":
        return await asyncio.to_thread(_link_into_place, Path(loc.path) / key, data)
    if loc.scheme == "s3":
        try:
            await asyncio.wait_for(loc.fs._pipe_file(f"{loc.path}/{key}", data, mode="create", ContentMD5=_md5(data)),
                                   S3_PUT_TIMEOUT)
        except FileExistsError:
            return False
        except OSError as e:
            if _precondition_failed(e):
                return False
            raise
        return True
    buf = default_buffer_prototype().buffer.from_bytes(data)
    await loc.store.set_if_not_exists(key, buf)
    stored = await loc.store.get(key, default_buffer_prototype())
    return stored is not None and stored.to_bytes() == data


def _precondition_failed(e: BaseException) -> bool:
    """Whether an S3 error is a 412 to a conditional PUT: the object exists. s3fs maps it to
    FileExistsError only when the error body names the condition, which SeaweedFS's and MinIO's
    do not (it then raises OSError(EINVAL) from botocore's ClientError)."""
    cause = e.__cause__ or e.__context__
    response = getattr(cause, "response", None) or {}
    return (response.get("Error", {}).get("Code") == "PreconditionFailed"
            or response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412)


async def put_atomic(loc: Location, key: str, data: bytes) -> None:
    """Create or replace ``key``; readers see the old object or the new one, never a mix."""
    if loc.scheme == "file":
        await asyncio.to_thread(replace_file, Path(loc.path) / key, data)
    elif loc.scheme == "s3":  # a PUT replaces an object in one step
        await asyncio.wait_for(loc.fs._pipe_file(f"{loc.path}/{key}", data, ContentMD5=_md5(data)), S3_PUT_TIMEOUT)
    else:
        await loc.store.set(key, default_buffer_prototype().buffer.from_bytes(data))


def _md5(data: bytes) -> str:
    """``Content-MD5`` of a metadata PUT: the server refuses a body that arrived incomplete
    (SeaweedFS, MinIO and AWS S3 check it) instead of storing a truncated commit."""
    return base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest()).decode()


async def make_durable(loc: Location, keys: list[str]) -> None:
    """Flush the objects at ``keys`` (and the directories naming them) to stable storage, so a
    commit written afterwards never points at data a power loss could take. Object stores
    acknowledge a PUT only once it is durable; local files need an fsync each."""
    if loc.scheme == "file":
        await asyncio.to_thread(_fsync_all, Path(loc.path), keys)


async def put_object(loc: Location, key: str, parts: list[Any], durable: bool) -> None:
    """Write the data object ``key``: ``parts`` (buffers) laid end to end.

    A local file is written from the parts as they are (no joined copy) into a temporary file
    renamed into place, so a file is never rewritten in place (readers may have it mapped);
    with ``durable`` it is fsynced before the rename, overlapping the disk's work with the
    encoding of the next object (:func:`make_durable` still runs before the commit; by then
    only directories cost anything). Elsewhere the parts become one PUT, durable once
    acknowledged.
    """
    if loc.scheme == "file":
        path = Path(loc.path) / key
        await asyncio.to_thread(lambda: os.replace(_write_aside(path, parts, durable), path))
    else:
        await loc.store.set(key, default_buffer_prototype().buffer.from_bytes(b"".join(parts)))


def _fsync_all(root: Path, keys: list[str]) -> None:
    dirs: set[Path] = set()
    for key in keys:
        path = root / key
        _fsync(path)
        dirs.update(p for p in path.parents if p == root or root in p.parents)
    for d in dirs:
        _fsync(d)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_aside(path: Path, data: Any, durable: bool = True) -> Path:
    """A fully written (and, if ``durable``, fsynced) temporary file next to ``path``, holding
    ``data``: bytes, or a list of buffers laid end to end (written one by one, never joined)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for part in data if isinstance(data, list) else [data]:
            view = memoryview(part).cast("B")
            while view:
                view = view[os.write(fd, view):]
        if durable:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    return tmp


def _link_into_place(path: Path, data: bytes) -> bool:
    tmp = _write_aside(path, data)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink()


def replace_file(path: Path, data: bytes) -> None:
    """Make the local file ``path`` hold ``data``, whole or not at all (an fsynced temporary
    file renamed over it)."""
    os.replace(_write_aside(path, data), path)


async def require_conditional_writes(loc: Location) -> None:
    """Refuse an S3 server that ignores ``If-None-Match: *``: there, two writers could both
    "create" a step's commit and one would silently overwrite the other's. Checked once per
    endpoint and process, by creating a probe object twice the way a commit is created."""
    if loc.scheme != "s3":
        return
    endpoint = loc.endpoint
    if endpoint not in _CONDITIONAL:
        key = f".amber-probe-{uuid.uuid4().hex}"
        try:
            await put_if_absent(loc, key, b"first")
            _CONDITIONAL[endpoint] = not await put_if_absent(loc, key, b"second")
        except (PermissionError, FileNotFoundError) as e:
            raise StorageAccessError(f"{loc.uri}: cannot write here ({_reason(e)})") from None
        finally:
            with suppress(FileNotFoundError):
                await loc.fs._rm_file(f"{loc.path}/{key}")
    if not _CONDITIONAL[endpoint]:
        raise UnsafeStorageError(
            f"{loc.uri}: the S3 server at {endpoint} ignores conditional writes (If-None-Match: *), so "
            "two writers could both commit one step and overwrite each other; use a server that "
            "honours them (AWS S3, MinIO since RELEASE.2024-11, SeaweedFS), or, if this store is only "
            "ever written by one process at a time, open it with single_writer=True"
        )


async def probe(loc: Location) -> None:
    """Fail now, with a clear message, if the location's storage cannot be used."""
    if loc.scheme == "file" and loc.store.read_only and not Path(loc.path).is_dir():
        raise NotAnAmberStoreError(f"{loc.uri}: no amber-store here (nothing to read)")
    if loc.fs is None:
        return
    bucket, _, prefix = loc.path.partition("/")
    try:
        if loc.scheme == "s3":
            # One request, within the store's own prefix: a listing of the bucket's root pages
            # through every top-level entry, and an access policy may allow only this prefix.
            await loc.fs._call_s3("list_objects_v2", Bucket=bucket, Prefix=f"{prefix}/" if prefix else "", MaxKeys=1)
        else:
            await loc.fs._info(loc.path)
    except FileNotFoundError:
        if loc.scheme == "s3":
            raise StorageAccessError(f"{loc.uri}: bucket {bucket!r} does not exist") from None
    except PermissionError as e:
        raise StorageAccessError(f"{loc.uri}: access denied; check the credentials ({_reason(e)})") from None
    except Exception as e:  # botocore, aiohttp and socket errors share no base class
        raise StorageAccessError(f"{loc.uri}: storage not usable: {_reason(e)}") from None
    finally:
        if getattr(loc.fs, "_s3", None) is not None:
            _track_client(loc.fs)


async def footprint(loc: Location) -> dict[str, int]:
    """What the location occupies: ``objects`` (files), ``bytes`` (their sizes) and
    ``allocated`` (disk blocks, local only; on object stores the same as ``bytes``), plus
    ``directories`` on local disks."""
    if loc.scheme == "file":
        return await asyncio.to_thread(_local_footprint, Path(loc.path))
    if loc.fs is not None:
        sizes = [info["size"] for info in (await loc.fs._find(loc.path, detail=True)).values()]
    else:
        sizes = []
        async for key in loc.store.list_prefix(""):
            sizes.append(await loc.store.getsize(key))
    return {"objects": len(sizes), "bytes": sum(sizes), "allocated": sum(sizes)}


def _local_footprint(root: Path) -> dict[str, int]:
    out = {"objects": 0, "bytes": 0, "allocated": 0, "directories": 0}
    for dirpath, dirnames, filenames in os.walk(root):
        out["directories"] += len(dirnames)
        for name in filenames:
            st = os.lstat(os.path.join(dirpath, name))
            out["objects"] += 1
            out["bytes"] += st.st_size
            out["allocated"] += st.st_blocks * 512
    return out


def is_storage_error(e: BaseException) -> bool:
    """I/O failures (disk, network, the object store's answers), as opposed to bugs."""
    return isinstance(e, (OSError, TimeoutError, asyncio.TimeoutError)) or type(e).__module__.split(".")[0] in (
        "botocore", "aiobotocore", "aiohttp", "s3fs")


@contextmanager
def storage_errors(uri: str, doing: str) -> Iterator[None]:
    """Turn an I/O failure inside the block into a :class:`StorageAccessError` saying what was
    being done where (botocore, aiohttp and OS errors share no base class); amber-store's own
    errors and bugs pass through."""
    try:
        yield
    except AmberError:
        raise
    except Exception as e:
        if not is_storage_error(e):
            raise
        raise StorageAccessError(f"{uri}: {doing} failed ({_reason(e)})") from e


def _reason(e: BaseException) -> str:
    name = type(e).__name__
    text = str(e).splitlines()[0] if str(e) else ""
    if "credential" in (name + text).lower():
        return f"no valid credentials found: {name}"
    return f"{name}: {text}"[:300]
