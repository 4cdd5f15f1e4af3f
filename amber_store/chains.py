"""Delta chains: which earlier steps of its segment a step's tensors diff against (the base
policies), and which steps' data materialize a tensor at a step (its chain), read from the
manifests :class:`~amber_store.history.History` holds. The writer asks where the next save's
deltas point; the reader, usage and retention, what a step reads."""

from __future__ import annotations

from typing import Callable

from .errors import CorruptDataError
from .format import Manifest, TensorEntry
from .history import History

# Which earlier position of a segment (0: the full step) a step at position p diffs against.
PARENTS: dict[str, Callable[[int], int]] = {
    "chain": lambda p: p - 1,
    "full": lambda p: 0,
    # Skip-list bases: clear the lowest set bit. A read walks popcount(p) + 1 arrays, at most
    # log2(full_every) + 1; a delta spans at most half the segment.
    "log": lambda p: p & (p - 1),
}
#: ``base_policy="auto"``: lossless deltas against the full step (a read decodes two layers;
#: measured on AdamW every 10 steps, benchmarks/policies.py: 2.7% more bytes than ``log``,
#: deepest loads 1.5x faster), lossy ones by skip list (their codes grow with the distance to
#: the base).
AUTO = {True: "full", False: "log"}
BASE_POLICIES = ("auto", *PARENTS)


def parent_policies(base_policy: str) -> tuple[str, ...]:
    """The parent rules (:data:`PARENTS`) a store's ``base_policy`` uses."""
    return tuple(AUTO.values()) if base_policy == "auto" else (base_policy,)


def parent_policy(base_policy: str, lossless: bool) -> str:
    """The parent rule of a tensor saved with a lossless (or lossy) codec."""
    return AUTO[lossless] if base_policy == "auto" else base_policy


def step_base(bases: dict[str, int], base_policy: str) -> int | None:
    """The base a manifest names for its step (its lossless tensors', if they have one)."""
    return bases.get(parent_policy(base_policy, True), next(iter(bases.values()), None))


def next_segment(prev: Manifest | None, bases: dict[str, int], step: int) -> list[int]:
    """The segment of ``step`` saved against ``bases`` (:meth:`History.base_steps`) after
    ``prev``: ``prev``'s segment and ``step``, or ``step`` alone for a full step."""
    return prev.segment + [step] if bases and prev is not None else [step]


class Chains:
    """The chains of the steps committed in ``history``."""

    def __init__(self, history: History) -> None:
        self.history = history

    async def holder(self, step: int, key: str) -> tuple[int, TensorEntry] | None:
        """The step whose data holds ``key``'s value at ``step`` (``same`` resolved), and its
        entry; ``None`` if the step has no such tensor."""
        e = await self.history.entry(step, key)
        if e is None:
            return None
        if e.encoding == "same":
            assert e.base is not None
            return e.base, await self._entry(e.base, key, step)
        return step, e

    async def chain(self, step: int, key: str) -> list[tuple[int, TensorEntry]]:
        """The layers that materialize ``key`` at ``step``, oldest (full) first; ``same``
        entries are skipped (they store nothing)."""
        layers: list[tuple[int, TensorEntry]] = []
        e = await self.history.entry(step, key)
        if e is None:
            raise KeyError(key)
        while True:
            if e.encoding != "same":
                layers.append((step, e))
            if e.encoding == "full" or e.base is None:
                return layers[::-1]
            e, step = await self._entry(e.base, key, step), e.base

    async def _entry(self, base: int, key: str, step: int) -> TensorEntry:
        """``key``'s entry in step ``base``, which step ``step`` names as its base."""
        e = await self.history.entry(base, key)
        if e is None:
            raise CorruptDataError.at(self.history.uri, step, key, f"its base step {base} has no such tensor")
        return e

    async def reads(self, step: int) -> set[int] | None:
        """The other steps whose data ``step`` may read directly (chains go on through theirs),
        from its index alone: its entries' bases, or for a sharded step (its entries are in
        fragments) the steps of its segment; ``None`` when the index cannot say."""
        m = await self.history.index(step)
        if m.fragments is None:
            return {e.base for e in m.tensors.values() if e.base is not None} - {step}
        return set(m.segment) - {step} if m.segment else None

    async def dependencies(self, step: int, key: str) -> list[int]:
        """Steps whose data is read to materialize ``key`` at ``step``, oldest first."""
        return [s for s, _ in await self.chain(step, key)]

    async def base_steps(self, prev: Manifest | None, base_policy: str, full_every: int,
                         full: bool | None, committed: list[int] | None = None) -> dict[str, int]:
        """The steps the next save diffs against, by parent rule (empty: a full step), given
        the latest and the committed steps (``None``: listed now; each listing is a round trip
        on S3).

        ``prev.segment`` lists the steps at positions ``0..prev.depth`` of its segment; the next
        step takes position ``depth + 1`` and diffs against the step at each rule's parent
        position, or, if retention deleted that one, the closest kept step before it.
        """
        if prev is None or full is True or len(prev.segment) != prev.depth + 1:
            return {}  # (steps of formats 1-2 record no segment: the next save is full)
        position = prev.depth + 1
        if full is None and position >= full_every:
            return {}
        kept = set(await self.history.steps() if committed is None else committed)
        bases = {}
        for policy in parent_policies(base_policy):
            candidates = [s for s in prev.segment[: PARENTS[policy](position) + 1] if s in kept]
            if candidates:
                bases[policy] = candidates[-1]
        return bases
