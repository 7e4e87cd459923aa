"""kvtier: a tiered KV cache store for LLM inference.

Blocks of K/V, keyed by chained content hashes, live in a GPU paged pool; LRU victims spill
to pinned CPU memory and then to LMDB on disk; hits come back up before prefill, so only the
new tokens of a prompt are computed. See docs/architecture.md.
"""

import os as _os

# Triton kernels live in the repository's top-level kernels/ folder and ship as kvtier.kernels
# (pyproject package-dir). Run from a source tree without installing, make the same import work.
_src_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "kernels")) and _os.path.isfile(
    _os.path.join(_src_root, "kernels", "__init__.py")
):
    __path__.append(_src_root)  # type: ignore[name-defined]

from kvtier.config import StoreConfig  # noqa: E402
from kvtier.hashing import KeyContext, hash_block_tokens  # noqa: E402
from kvtier.store import LookupResult, TieredStore  # noqa: E402
from kvtier.types import BlockHash, KVSpec, Medium  # noqa: E402

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
