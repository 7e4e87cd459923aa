"""Reset: empty every tier of a running store (``TieredStore.reset``), or a data directory's
DISK tier offline (:func:`clear_data_dir`, what ``kvtier clear`` calls).

Why a reset exists: the same block hashes may stand for other K/V after a change the key
does not see (weights updated in place under the same revision, a kernel fix): vLLM's
``reset_prefix_cache(reset_connector=True)`` asks the connector for the same. So after a
reset no tier may serve a block stored before it, and nothing in flight may bring one back:

1. under the store's lock: background writes in flight (write-through to DISK, REMOTE puts)
   are waited for, so none lands after the reset; then the pools are emptied and a new
   generation starts (:meth:`~kvtier.store.residency.Residency.retire`: slots still pinned or
   with a transfer in flight stay held for their owners, who publish nothing), and DISK drops
   every record (fsynced);
2. outside the lock (REMOTE calls never run under it): the REMOTE namespace is emptied if the
   backend can (``clear_namespace``); meanwhile lookups do not ask REMOTE, and a lookup walk
   that began before the reset drops its REMOTE part (:mod:`kvtier.store.lookup`).

Counters (``stats``) are history and stay; usage goes to 0.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Sequence

from kvtier.store.residency import Residency
from kvtier.tiers.backend import RemoteBackend
from kvtier.tiers.disk import DiskTier, clear_directory
from kvtier.tiers.pool import BlockPool

logger = logging.getLogger(__name__)


def empty_local_tiers(pools: Sequence[BlockPool], disk: DiskTier | None, residency: Residency) -> dict[str, int]:
    """Step 1 after the writes were waited for (the caller holds the lock): the published
    blocks dropped per tier.

    Raises:
        RuntimeError: DISK is read-only here (a forked child's view); nothing was changed.
    """
    if disk is not None and disk.read_only:
        raise RuntimeError(f"cannot reset the DISK tier at {disk.path} from a forked child; reset it "
                           "from the process that opened the store")
    dropped = {
        str(pool.medium): sum(1 for h in pool.lru_order() if not residency.is_pending(pool.medium, h))
        for pool in pools
    }
    residency.retire(pools)
    if disk is not None:
        dropped["DISK"] = disk.clear()
    return dropped


def empty_remote(remote: RemoteBackend, namespace: bytes) -> int | None:
    """Step 2: the blocks the backend deleted from ``namespace``, or ``None`` when it cannot
    empty a namespace or could not be reached (logged). Call without the store's lock."""
    clear = getattr(remote, "clear_namespace", None)
    if clear is None:
        logger.warning("reset: the REMOTE tier %r cannot empty a namespace; its blocks stay until evicted", remote)
        return None
    try:
        removed = clear(namespace)
    except Exception as exc:  # a backend bug must not leave the store half reset and raising
        logger.warning("reset: emptying the REMOTE namespace failed: %s", repr(exc))
        return None
    if removed is None:
        logger.warning("reset: the REMOTE tier %r could not be reached; its blocks stay (reset again)", remote)
        return None
    return int(removed)


def clear_data_dir(data_dir: str | os.PathLike) -> int:
    """Empty the DISK tier of a store's data directory (``StoreConfig.data_dir``; the tier
    is in its ``disk/``) while no store has it open. Returns the records dropped.

    Raises:
        FileNotFoundError: no DISK tier there (nothing is created).
        RuntimeError: a store (in this process or another) has it open: reset that store
            instead (``TieredStore.reset``).
    """
    return clear_directory(Path(data_dir) / "disk")
