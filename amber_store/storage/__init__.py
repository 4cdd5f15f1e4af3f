"""Where a store's objects live: one :class:`Backend` per kind of storage, chosen by the URI.

=================================  ===========================================================
``/path``, ``file:///path``        :mod:`~amber_store.storage.local` (NVMe, shared filesystems)
``memory://name``                  :mod:`~amber_store.storage.memory` (this process)
``s3://bucket/prefix``             :mod:`~amber_store.storage.s3_obstore` (AWS S3, MinIO, SeaweedFS;
                                   ``client="s3fs"``: :mod:`~amber_store.storage.s3`)
``gs://bucket/prefix``             :mod:`~amber_store.storage.gcs` (gcsfs)
``az://container/prefix``          :mod:`~amber_store.storage.azure_obstore` (Azure Blob, Azurite;
                                   ``client="adlfs"``: :mod:`~amber_store.storage.azure`)
a zarr store object                :mod:`~amber_store.storage.zarrstore` (zarr's API as it is)
=================================  ===========================================================

:data:`~amber_store.storage.registry.BACKENDS` maps schemes to classes; :func:`register` (or an
entry point in the group ``amber_store.backends``) adds one from outside the package. Only
History and the Writer hold a backend, and nothing else looks at a scheme.
"""

from .base import Backend, is_storage_error, reason, storage_errors
from .registry import BACKENDS, ENTRY_POINTS, backend_class, connect, register, resolve, supported

__all__ = ["BACKENDS", "ENTRY_POINTS", "Backend", "backend_class", "connect", "is_storage_error", "reason", "register",
           "resolve", "storage_errors", "supported"]
