"""kvtier: a tiered KV cache store for LLM inference.

Blocks of K/V, keyed by chained content hashes, live in a GPU paged pool; LRU victims spill
to pinned CPU memory and then to LMDB on disk; hits come back up before prefill, so only the
new tokens of a prompt are computed. See docs/architecture.md.
"""

from kvtier.config import StoreConfig
from kvtier.hashing import KeyContext, hash_block_tokens
from kvtier.store import LookupResult, TieredStore
from kvtier.types import BlockHash, KVSpec, Medium

__all__ = [
    "BlockHash",
    "KVSpec",
    "KeyContext",
    "LookupResult",
    "Medium",
    "StoreConfig",
    "TieredStore",
    "hash_block_tokens",
]
__version__ = "0.1.0"
