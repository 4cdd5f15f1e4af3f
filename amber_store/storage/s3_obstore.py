"""``s3://bucket/prefix`` (and ``s3a://``) on obstore (:mod:`~amber_store.storage.obstorestore`):
AWS S3, MinIO, SeaweedFS or any S3 server.

The default S3 client: on SeaweedFS (loopback, 2 cores) it loaded a delta step 1.28-1.43x and
saved 1.1-1.36x faster than s3fs, over three runs of benchmarks/throughput.py. Options are the
ones users pass to s3fs (``endpoint_url``, ``key``, ``secret``, ``token``, ``region``,
``profile``, ``anon``), and the standard AWS environment is honoured (``AWS_ENDPOINT_URL[_S3]``,
``AWS_REGION``, credentials, and profiles, which botocore reads for it). ``client="s3fs"``, or
an option only s3fs knows (``client_kwargs``, ``config_kwargs``, ``session``, ...), selects the
s3fs backend (:mod:`amber_store.storage.s3`). The commit is a conditional PUT
(``If-None-Match: *``); every request is bounded (:mod:`~amber_store.storage.obstorestore`). Uploads in
parts that failed are aborted, and gc lists and aborts those a killed process left, through
botocore (obstore does neither).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import re
import time
from typing import Any
from urllib.parse import SplitResult

from ..errors import InvalidURIError, StorageAccessError
from .base import Backend, Upload
from .obstorestore import RETRY, ObstoreBackend, client_options, renamed

#: How long a failed upload in parts may spend aborting itself.
ABORT_SECONDS = 30.0
#: How long the botocore client of upload listings and aborts is used before it is made again.
CLIENT_SECONDS = 240.0
#: Options that only s3fs understands: with any of them, the store goes through s3fs.
S3FS_ONLY = frozenset({"client_kwargs", "config_kwargs", "session", "s3_additional_kwargs", "requester_pays",
                       "default_block_size", "default_fill_cache", "version_aware", "cache_regions",
                       "asynchronous", "loop", "use_ssl", "max_concurrency", "fixed_upload_size"})
#: storage_options -> obstore's S3 configuration keys
_RENAMED = {"key": "access_key_id", "secret": "secret_access_key", "token": "session_token", "region": "region",
            "endpoint_url": "endpoint"}


class ObstoreS3Backend(ObstoreBackend):
    """An S3 bucket prefix, through obstore."""

    schemes = ("s3", "s3a")
    condition = "If-None-Match: *"
    honoured_by = "AWS S3, MinIO since RELEASE.2024-11, SeaweedFS"
    missing_container = r"NoSuchBucket|404 Not Found"
    fsspec_client = ("s3fs", "amber_store.storage.s3:S3Backend", S3FS_ONLY)

    def __init__(self, client: Any, bucket: str, prefix: str, uri: str, read_only: bool, endpoint: str) -> None:
        super().__init__(client, uri, f"{bucket}/{prefix}".rstrip("/"), read_only, endpoint)
        self._bucket, self._prefix = bucket, prefix.strip("/")
        self._config: dict[str, Any] = {}
        self._provider: Any = None
        self._aborting: set[asyncio.Task[None]] = set()
        self._botocore: tuple[float, Any] | None = None  # (made at, client): :meth:`_uploads_client`

    @classmethod
    def from_uri(cls, uri: str, parts: SplitResult, storage_options: dict[str, Any],
                 read_only: bool) -> Backend:
        opts = dict(storage_options)
        if (other := cls.through_fsspec(uri, parts, opts, read_only)) is not None:
            return other
        from obstore.store import S3Store

        text, path = cls.located(uri, parts._replace(scheme="s3"))
        bucket, _, prefix = path.partition("/")
        config, provider = s3_config(opts, uri)
        try:
            store = S3Store(bucket, prefix=prefix or None, config=config,
                            client_options=client_options(config.get("endpoint")), retry_config=RETRY,
                            credential_provider=provider)
        except Exception as e:  # obstore reports bad configuration as its own errors
            raise InvalidURIError(f"{text}: cannot create an S3 client: {e}") from None
        backend = cls(store, bucket, prefix, text, read_only, config.get("endpoint") or "AWS S3")
        backend._config, backend._provider = config, provider
        return backend

    def upload_failed(self, key: str) -> None:
        """Abort it: its parts would stay, billed and invisible."""
        task = asyncio.ensure_future(self._abort_uploads_of(key))
        self._aborting.add(task)
        task.add_done_callback(self._aborting.discard)

    def racing(self, e: Exception) -> bool:
        """AWS answers 409 (ConditionalRequestConflict) to a conditional write racing another on
        the same key, which obstore reports as "exists"; a 412 is the answer that it exists."""
        return re.search(r"status code:? 409\b", str(e)) is not None

    async def _abort_uploads_of(self, key: str) -> None:
        """Abort the incomplete uploads of ``key`` (best effort, bounded: gc removes what is left)."""
        async def abort() -> None:
            for upload in await self.incomplete_uploads(key):
                await self.abort_upload(upload)

        with contextlib.suppress(Exception):
            await asyncio.wait_for(abort(), ABORT_SECONDS)

    async def incomplete_uploads(self, key: str | None = None) -> list[Upload]:
        """The location's (or ``key``'s) uploads in parts begun and never completed, as S3's
        ListMultipartUploads tells them."""
        prefix = self._key(key) if key is not None else (f"{self._prefix}/" if self._prefix else "")

        def listed() -> list[Upload]:
            pages = self._uploads_client().get_paginator("list_multipart_uploads").paginate(
                Bucket=self._bucket, Prefix=prefix)
            return [Upload(u["Key"][len(self._prefix) + 1 if self._prefix else 0:], u["UploadId"],
                           u["Initiated"].timestamp())
                    for page in pages for u in page.get("Uploads", []) if key is None or u["Key"] == prefix]

        return await asyncio.to_thread(listed)

    async def abort_upload(self, upload: Upload) -> None:
        await asyncio.to_thread(self._uploads_client().abort_multipart_upload, Bucket=self._bucket,
                                Key=self._key(upload.key), UploadId=upload.upload_id)

    def _key(self, key: str) -> str:
        return f"{self._prefix}/{key}" if self._prefix else key

    def _uploads_client(self) -> Any:
        """A botocore client for what obstore does not do (listing and aborting uploads), with the
        same endpoint, region and credentials; made once and used for :data:`CLIENT_SECONDS`
        (credentials from a provider are handed out for five minutes)."""
        now = time.monotonic()
        if self._botocore is None or now - self._botocore[0] > CLIENT_SECONDS:
            self._botocore = (now, self._new_uploads_client())
        return self._botocore[1]

    def _new_uploads_client(self) -> Any:
        import botocore
        import botocore.config
        import botocore.session

        config = self._config
        creds: dict[str, Any] = {}
        if "access_key_id" in config:
            creds = {"aws_access_key_id": config["access_key_id"], "aws_secret_access_key": config.get("secret_access_key"),
                     "aws_session_token": config.get("session_token")}
        elif self._provider is not None:
            frozen = self._provider()
            creds = {"aws_access_key_id": frozen["access_key_id"], "aws_secret_access_key": frozen["secret_access_key"],
                     "aws_session_token": frozen["token"]}
        options = botocore.config.Config(
            s3={"addressing_style": "virtual" if config.get("virtual_hosted_style_request", True) else "path"},
            connect_timeout=5, read_timeout=15, retries={"max_attempts": 3},
            signature_version=botocore.UNSIGNED if config.get("skip_signature") else None)
        return botocore.session.get_session().create_client(
            "s3", endpoint_url=config.get("endpoint"), region_name=config.get("region"), config=options, **creds)


def s3_config(storage_options: dict[str, Any], uri: str) -> tuple[dict[str, Any], Any]:
    """obstore's S3 configuration from s3fs-style options (over the AWS environment, which
    obstore reads itself), and a credential provider where botocore must find them (a profile,
    the shared credentials and config files)."""
    opts = dict(storage_options)
    config = renamed(opts, _RENAMED)
    anon = bool(opts.pop("anon", False))
    profile = opts.pop("profile", None)
    if opts:
        raise InvalidURIError(f"{uri}: unknown storage_options {sorted(opts)} for s3:// (the obstore client takes "
                              f"{sorted([*_RENAMED, 'anon', 'profile', 'client'])}; client='s3fs' takes s3fs's)")
    endpoint = config.get("endpoint") or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        config["endpoint"] = endpoint
        config.setdefault("virtual_hosted_style_request", False)  # MinIO and others want path style
    config.setdefault("region", os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1")
    if anon:
        config["skip_signature"] = True
        return config, None
    if "access_key_id" in config or (profile is None and os.environ.get("AWS_ACCESS_KEY_ID")):
        return config, None
    provider = _botocore_credentials(profile)
    if provider is None:  # (botocore's chain covers obstore's: the metadata service, web identity, ECS)
        raise StorageAccessError(f"{uri}: no valid credentials found: pass key and secret in storage_options, set "
                                 "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, name a profile, or anon=True for a "
                                 "public bucket")
    return config, provider


def _botocore_credentials(profile: str | None) -> Any:
    """Credentials as botocore finds them (a profile, the shared files, SSO, the instance
    metadata service, ...), asked again each time obstore's copy expires; ``None`` where
    botocore finds none."""
    from botocore.session import Session

    try:
        found = Session(profile=profile).get_credentials()
    except Exception as e:  # an unknown profile, a malformed file
        raise InvalidURIError(f"cannot read AWS credentials{f' of profile {profile!r}' if profile else ''}: {e}") \
            from None
    if found is None:
        return None

    def provider() -> dict[str, Any]:
        frozen = found.get_frozen_credentials()
        return {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key, "token": frozen.token,
                "expires_at": datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=5)}

    return provider

