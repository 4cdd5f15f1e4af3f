"""The on-disk contract (docs/FORMAT.md), with no I/O: plain JSON and zarr v3 metadata that any
zarr reader can inspect, versioned so that readers refuse a ``format_version`` newer than
:data:`FORMAT_VERSION`.

- :mod:`.layout`: keys, versions, encodings and zarr metadata of the hierarchy;
- :mod:`.dtypes`: dtypes as stored (raw bits) and host memory for them;
- :mod:`.chunks`: chunk geometry and checksums;
- :mod:`.tree`: the state-dict tree, flattened and back;
- :mod:`.manifest`: a committed step and its tensor entries;
- :mod:`.sharding`: a sharded tensor's shards described once (a grid);
- :mod:`.fragments`: one rank's records of a sharded step, in binary columns.
"""

from __future__ import annotations

from typing import Any

from .layout import (  # noqa: F401
    FORMAT_NAME, FORMAT_VERSION, ROOT_ATTR, COMMITS_DIR, CLAIMS_DIR, STEPS_DIR, DEFAULT_CHUNK_BYTES,
    LOSSY_CHUNK_BYTES, PACK_CHUNK_BYTES, DEFAULT_PACK_THRESHOLD, PACK_ALIGN, PACK_PREFIX, Encoding,
    DELTA_ENCODINGS, EXTENSION_ENCODING, SERIALIZERS, commit_key, claim_key, parse_commit_key, step_group, group_metadata,
    array_name, regular_chunk_grid, sharded_array_metadata, shard_key, shard_index, step_group_metadata,
)
from .dtypes import (  # noqa: F401
    ITEMSIZES, dtype_name, itemsize, bits_numpy_dtype, to_bits, bits_to_numpy, numpy_to_tensor, host_empty,
    populate,
)
from .chunks import (  # noqa: F401
    choose_chunks, round_up, chunk_grid, iter_chunk_indices, chunk_slices, region_chunks, chunk_runs, whole,
    region_crcs, tensor_crcs,
)
from .tree import (  # noqa: F401
    escape_segment, FlattenMemo, flatten, unflatten,
)
from .manifest import (  # noqa: F401
    TensorEntry, Manifest,
)
from . import dtypes as _dtypes
from . import fragments, sharding  # noqa: F401


def __getattr__(name: str) -> Any:
    if name in ("DTYPES", "_madvise"):  # (DTYPES imports torch on first use)
        return getattr(_dtypes, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
