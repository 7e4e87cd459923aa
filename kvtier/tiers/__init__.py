"""Storage tiers: GPU/CPU block pools (pool.py) and the LMDB DISK tier (disk.py)."""

from kvtier.records import ReadStatus
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.pool import BlockPool

__all__ = ["BlockPool", "DiskTier", "ReadStatus"]
