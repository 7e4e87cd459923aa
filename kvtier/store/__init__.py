"""The tiered KV block store: :class:`TieredStore` and the types of its protocol.

Modules, bottom to top (each imports only those below it):

- :mod:`~kvtier.store.results`: what callers get (``Lease``, ``LookupResult``, ``LoadResult``,
  ``StoreHandle``, ``StoreStats``).
- :mod:`~kvtier.store.residency`: pins (``ref_cnt``), pending slots, protected blocks,
  deferred cleanups and the store's lock; the only code that changes them.
- :mod:`~kvtier.store.placement`: where a block lives in the local tiers; eviction and spills.
- :mod:`~kvtier.store.writes`: background writes (write-through to DISK, REMOTE puts).
- :mod:`~kvtier.store.stores`: the store path (prepare -> write -> complete, chunked).
- :mod:`~kvtier.store.lookup`: the one lookup path (local tiers, REMOTE outside the lock),
  counted once; used by lookups and prefetches alike.
- :mod:`~kvtier.store.prefetch`: prefetch planning and the ``PrefetchHandle``.
- :mod:`~kvtier.store.reset`: emptying every tier of a running store, or a data
  directory's DISK tier offline (``clear_data_dir``).
- :mod:`~kvtier.store.tiered_store`: the facade, ``TieredStore``.
"""

from kvtier.store.prefetch import PrefetchHandle
from kvtier.store.reset import clear_data_dir
from kvtier.store.results import Lease, LoadResult, LookupResult, ResetResult, StoreHandle, StoreStats
from kvtier.store.tiered_store import TieredStore

__all__ = [
    "Lease", "LoadResult", "LookupResult", "PrefetchHandle", "ResetResult", "StoreHandle", "StoreStats", "TieredStore",
    "clear_data_dir",
]
