"""Segmented LRU order for a tier's index (SLRU; Karedla, Love & Wherry, IEEE Computer 1994).

New blocks enter the *probation* segment; a block used again (a hit, or a store of a block
already present) moves to the *protected* segment. Victims are taken from probation first,
least recently used first, then from protected. So a scan of one-time prompts larger than the
cache cannot flush a prefix that is actually reused (case E1: a hot system prompt shared by
every 10th request keeps hitting while unique prompts of 3x the capacity stream past), while
a stream of single-use blocks is evicted in exact LRU order.

Protected holds at most ``protected_fraction`` of the entries; past that its least recently
used entry is demoted to the most recent end of probation, so a hot set that changes is
replaced in time.

Like 2Q's A1out list (Johnson & Shasha, VLDB 1994), the keys of recently evicted entries are
remembered (keys only, at most ``max_ghosts``): an entry that comes back soon after its
eviction has proven reuse and enters protected directly. This is what keeps a prefix whose
reuse distance exceeds the cache (a hot prompt between long scans) from missing forever.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Hashable, Iterator, Mapping, Sequence, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SegmentedLRU(Generic[K, V]):
    """Ordered index ``key -> value`` with SLRU eviction order."""

    def __init__(self, max_ghosts: int, protected_fraction: float = 0.8) -> None:
        assert 0.0 < protected_fraction < 1.0
        self.protected_fraction = protected_fraction
        self.max_ghosts = max_ghosts
        self._probation: OrderedDict[K, V] = OrderedDict()
        self._protected: OrderedDict[K, V] = OrderedDict()
        self._ghosts: OrderedDict[K, None] = OrderedDict()  # recently evicted keys

    def __contains__(self, key: K) -> bool:
        return key in self._probation or key in self._protected

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def segments(self) -> tuple[Mapping[K, V], Mapping[K, V]]:
        """The two segments (probation, protected): ``key in self`` is ``key in`` either.
        For callers that test many keys in one loop (a function call per key costs more
        than the test itself); read them, never change them."""
        return self._probation, self._protected

    def get(self, key: K, default: V | None = None) -> V | None:
        if key in self._probation:
            return self._probation[key]
        return self._protected.get(key, default)

    def __getitem__(self, key: K) -> V:
        value = self.get(key)
        if value is None and key not in self:
            raise KeyError(key)
        return value  # type: ignore[return-value]

    def items(self) -> list[tuple[K, V]]:
        return list(self._probation.items()) + list(self._protected.items())

    def values(self) -> list[V]:
        return list(self._probation.values()) + list(self._protected.values())

    def is_protected(self, key: K) -> bool:
        return key in self._protected

    def was_evicted(self, key: K) -> bool:
        """Whether ``key`` is a ghost: evicted recently (among the last ``max_ghosts``
        victims) and not indexed again since. Read-only (explains misses)."""
        return key in self._ghosts

    def add(self, key: K, value: V) -> None:
        """Insert a new entry at the most recent end of probation (of protected, when it was
        evicted recently)."""
        assert key not in self, "key already indexed"
        self._probation[key] = value
        if self._ghosts.pop(key, 0) is None:
            self.touch(key)

    def refresh(self, key: K) -> None:
        """Make ``key`` most recent within its segment (no promotion)."""
        (self._protected if key in self._protected else self._probation).move_to_end(key)

    def touch(self, key: K) -> None:
        """A use: move ``key`` to the most recent end of protected."""
        if key in self._probation:
            self._protected[key] = self._probation.pop(key)
        else:
            self._protected.move_to_end(key)
        self._bound_protected()

    def _bound_protected(self) -> None:
        """Demote protected's least recent entries to probation while it is over its bound."""
        limit = max(1, int(self.protected_fraction * len(self)))
        while len(self._protected) > limit:
            demoted, value = self._protected.popitem(last=False)
            self._probation[demoted] = value

    def touch_many(self, keys: Sequence[K]) -> None:
        """:meth:`touch` of each of ``keys`` that is indexed (others are skipped), in order,
        with the protected segment's bound enforced once at the end. The resulting order is
        that of touching them one by one: the bound does not change while touching (touches
        keep the entry count), and the entries over it leave protected least recent first
        either way; but it is one pass, without a method call per key."""
        probation, protected = self._probation, self._protected
        for key in keys:
            if key in probation:
                protected[key] = probation.pop(key)
            elif key in protected:
                protected.move_to_end(key)
        self._bound_protected()

    def pop(self, key: K, evicted: bool = False) -> V:
        """Remove ``key``; ``evicted=True`` remembers it as a ghost (see the module doc)."""
        value = self._probation.pop(key) if key in self._probation else self._protected.pop(key)
        if evicted and self.max_ghosts:
            self._ghosts[key] = None
            if len(self._ghosts) > self.max_ghosts:
                self._ghosts.popitem(last=False)
        return value

    def clear(self) -> None:
        self._probation.clear()
        self._protected.clear()
        self._ghosts.clear()

    def eviction_order(self) -> Iterator[K]:
        """Keys in the order they would be evicted. Lazy: stop early, and do not change the
        index while iterating (collect victims first)."""
        yield from self._probation
        yield from self._protected
