"""kvtier: a tiered KV cache store for LLM inference.

Blocks of K/V, keyed by chained content hashes, live in a GPU paged pool; LRU victims spill
to pinned CPU memory and then to LMDB on disk; hits come back up before prefill, so only the
new tokens of a prompt are computed. See docs/architecture.md.

The names below are imported on first use (PEP 562 ``__getattr__``): ``import kvtier`` alone
imports neither torch nor the store, so ``kvtier --help`` (kvtier.app.cli) answers at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.config import StoreConfig
    from kvtier.hashing import KeyContext, block_keys_for, hash_block_tokens
    from kvtier.store import LookupResult, TieredStore
    from kvtier.types import BlockHash, KVSpec, Medium

_EXPORTS = {
    "BlockHash": "kvtier.types",
    "KVSpec": "kvtier.types",
    "KeyContext": "kvtier.hashing",
    "LookupResult": "kvtier.store",
    "Medium": "kvtier.types",
    "StoreConfig": "kvtier.config",
    "TieredStore": "kvtier.store",
    "block_keys_for": "kvtier.hashing",
    "hash_block_tokens": "kvtier.hashing",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
