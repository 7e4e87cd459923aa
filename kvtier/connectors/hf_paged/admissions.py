"""What the connector did for each request: cached tokens per source, and running totals."""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

PAGED = "paged"
"""Source name of the tokens transformers' own prefix sharing supplied (its paged cache)."""


@dataclass(frozen=True, slots=True)
class Admission:
    """One request's admission.

    Attributes:
        request_id: transformers' request id.
        prompt_tokens: tokens of the prompt at admission.
        cached_by_source: cached prompt tokens per source: ``"paged"`` (transformers' own
            prefix match) and the kvtier tier each loaded block came from (``"GPU"``,
            ``"CPU"``, ``"DISK"``, ``"REMOTE"``).
        late: the kvtier load was still in flight at the deadline (those tokens were computed).
    """

    request_id: str
    prompt_tokens: int
    cached_by_source: dict[str, int]
    late: bool = False

    @property
    def cached_tokens(self) -> int:
        return sum(self.cached_by_source.values())

    @property
    def kvtier_tokens(self) -> int:
        return sum(n for source, n in self.cached_by_source.items() if source != PAGED)


@dataclass
class PagedStats:
    """Totals over every admission (tokens), loads and stores (kvtier blocks)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_by_source: Counter = field(default_factory=Counter)
    late_loads: int = 0
    stored_blocks: int = 0
    errors: int = 0
    """Exceptions caught in a hook (logged; the engine went on without kvtier for that step)."""


class Admissions:
    """The last ``capacity`` admissions by request id (thread-safe), and the totals."""

    def __init__(self, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self.stats = PagedStats()
        self._by_id: OrderedDict[str, Admission] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, admission: Admission) -> None:
        with self._lock:
            self._by_id[admission.request_id] = admission
            self._by_id.move_to_end(admission.request_id)
            while len(self._by_id) > self.capacity:
                self._by_id.popitem(last=False)
            self.stats.requests += 1
            self.stats.prompt_tokens += admission.prompt_tokens
            self.stats.cached_by_source.update(admission.cached_by_source)
            self.stats.late_loads += int(admission.late)

    def pop(self, request_id: str) -> Admission | None:
        with self._lock:
            return self._by_id.pop(request_id, None)

    def get(self, request_id: str) -> Admission | None:
        with self._lock:
            return self._by_id.get(request_id)
