"""Test doubles and fault injection for kvtier's tiers (used by tests/reliability and bench/soak.py).

- :mod:`kvtier.testing.faults`: :class:`~kvtier.testing.faults.FaultPlan` (which faults, on
  which calls), :func:`~kvtier.testing.faults.inject_disk_faults` (a DISK tier that fails,
  lies, stalls or fills up) and :func:`~kvtier.testing.faults.abandon` (a simulated crash).
- :mod:`kvtier.testing.remote`: :class:`~kvtier.testing.remote.MemoryRemote` (an in-memory
  REMOTE backend with the same kinds of faults) and
  :func:`~kvtier.testing.remote.inject_remote_faults` (faults around any REMOTE backend).
"""

from kvtier.testing.faults import (
    DISK_READ_FAULTS,
    DISK_WRITE_FAULTS,
    REMOTE_FAULTS,
    Fault,
    FaultPlan,
    Hit,
    Injection,
    abandon,
    inject_disk_faults,
)
from kvtier.testing.remote import MemoryRemote, inject_remote_faults

__all__ = [
    "DISK_READ_FAULTS",
    "DISK_WRITE_FAULTS",
    "REMOTE_FAULTS",
    "Fault",
    "FaultPlan",
    "Hit",
    "Injection",
    "MemoryRemote",
    "abandon",
    "inject_disk_faults",
    "inject_remote_faults",
]
