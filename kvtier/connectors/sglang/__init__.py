"""kvtier as an SGLang HiCache L3 storage backend.

SGLang loads it as a dynamic backend::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.connectors.sglang", "class_name": "KVTierStorage",
        "interface_v1": 1, "disk_bytes": "20GiB"}'

``KVTierStorage`` (:mod:`.backend`) subclasses SGLang's ``HiCacheStorage`` and is imported on
first use, so :mod:`.keys`, :mod:`.layout` and :mod:`.options` import without SGLang.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVTierStorage"]


def __getattr__(name: str) -> Any:
    if name == "KVTierStorage":
        from kvtier.connectors.sglang.backend import KVTierStorage

        return KVTierStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
