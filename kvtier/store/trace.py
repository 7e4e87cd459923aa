"""An opt-in trace of a store's block requests, for ``kvtier replay`` (sizing the tiers).

Written only when asked (``StoreConfig.trace_path`` / ``KVTIER_TRACE_PATH``): one JSON object
per line, block hashes only (their first 8 bytes as an unsigned little-endian integer: no
token ids, no namespace, nothing of the prompt's text)::

    {"kvtier_trace": 1, "block_size": 16, "tiers": {"GPU": 4096, "CPU": 16384, "DISK": 131072},
     "write_policy": "write_back", "stage_on_cpu": false}                 (first line)
    {"t": 0.0123, "op": "load", "hash_ids": [...], "num_tokens": 517}     a counted prefetch
    {"t": 0.0150, "op": "lookup", "hash_ids": [...]}                      a counted lookup only
    {"t": 0.0311, "op": "store", "hash_ids": [...]}                       a store (one chunk)

``tiers`` gives each local tier's capacity in blocks (DISK: its byte cap over one record's
page-rounded footprint), so a replay at the trace's own capacities reproduces the run. ``t``
is seconds since the store opened. Only counted lookups are traced (a retried request counts
once, as in ``stats``). The file is appended to, line-buffered, and closed with the store.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Sequence

from kvtier.types import BlockHash

if TYPE_CHECKING:
    from kvtier.config import StoreConfig
    from kvtier.tiers.disk import DiskTier
    from kvtier.tiers.pool import BlockPool
    from kvtier.types import KVSpec

TRACE_VERSION = 1


def hash_id(block_hash: bytes) -> int:
    """The integer a trace records for ``block_hash`` (its first 8 bytes, little-endian)."""
    return int.from_bytes(block_hash[:8], "little")


class StoreTrace:
    """Appends a store's block requests to ``path`` (see the module docstring).

    Args:
        path: the trace file (created with its parents; appended to if it exists).
        header: the first line's fields (block size, tier capacities in blocks, policies).

    Raises:
        OSError: the file cannot be opened.
    """

    def __init__(self, path: str | Path, header: dict[str, Any]) -> None:
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: IO[str] | None = open(path, "a", buffering=1, encoding="utf-8")
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._write({"kvtier_trace": TRACE_VERSION, **header})

    def record(self, op: str, block_hashes: Sequence[BlockHash], num_tokens: int | None = None) -> None:
        """One request: ``op`` is ``"load"``, ``"lookup"`` or ``"store"``."""
        entry: dict[str, Any] = {"t": round(time.monotonic() - self._t0, 6), "op": op,
                                 "hash_ids": [hash_id(h) for h in block_hashes]}
        if num_tokens is not None:
            entry["num_tokens"] = num_tokens
        self._write(entry)

    def _write(self, entry: dict[str, Any]) -> None:
        line = json.dumps(entry, separators=(",", ":")) + "\n"
        with self._lock:
            if self._file is not None:
                self._file.write(line)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def open_trace(
    config: "StoreConfig", spec: "KVSpec", pools: "list[BlockPool]", disk: "DiskTier | None"
) -> StoreTrace | None:
    """The store's trace when ``config.trace_path`` asks for one, else ``None``."""
    if config.trace_path is None:
        return None
    tiers = {str(p.medium): p.num_blocks for p in pools}
    if disk is not None:
        tiers["DISK"] = disk.capacity_bytes // disk.footprint(spec.block_nbytes)
    return StoreTrace(config.trace_path, {
        "block_size": spec.block_size, "tiers": tiers, "write_policy": config.write_policy,
        "stage_on_cpu": bool(pools) and pools[0].tensor.device.type != "cpu",
    })
