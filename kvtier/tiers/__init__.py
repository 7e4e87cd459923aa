"""Storage tiers: GPU/CPU block pools (pool.py) and the LMDB DISK tier (disk.py)."""

from kvtier.tiers.disk import DiskTier, ReadStatus
from kvtier.tiers.pool import BlockPool

__all__ = ["BlockPool", "DiskTier", "ReadStatus"]
