"""Fault injection for kvtier's tiers: fault plans, a DISK that fails, lies, stalls or fills
up, and a simulated crash (the REMOTE side is :mod:`kvtier.testing.remote`). For tests and
soak runs, never for production.

Which calls fail is a :class:`FaultPlan`: a list of :class:`Fault` rules, each for one
operation, firing with a probability per call (seeded, and keyed by block so that thread
interleaving does not change which blocks fail), on scripted call numbers, or only on named
blocks (``keys``)::

    plan = FaultPlan([Fault("read", "corrupt", p=0.3), Fault("write", "full", calls={2})], seed=1)
    with inject_disk_faults(store, plan):        # store.disk now misbehaves
        ...
    plan.injected                                # what actually fired: [Injection(...)]

DISK faults are injected *below* the tier's own checks, where real faults happen, so the
tier's and the store's handling is what is tested (not a stub of it):

- reads (op ``"read"``, one call per block read, inside the LMDB read transaction of
  ``DiskTier.read_into`` or ``read_into_views``; a write transaction's read-back is left alone): ``error`` (the read raises ``lmdb.DiskError``), ``readers_full``
  (``lmdb.ReadersFullError``), ``corrupt`` (one bit of the record flipped on its way out of the
  map: header or payload), ``truncate`` (a short value), ``missing`` (the record vanished),
  ``delay`` (a slow read, ``delay_s``). The record on disk stays intact (a transient fault).
- writes (op ``"write"``, one call per ``DiskTier.write_batch`` with puts): ``full`` (the
  transaction's put raises ``lmdb.MapFullError``: the LMDB map is full), ``error``
  (``lmdb.DiskError``), ``enospc`` (the filesystem-free-space check says full), ``corrupt``
  (one record is committed with one payload bit flipped: at-rest damage a later read must
  catch), ``delay`` (a slow disk), ``raise`` (``write_batch`` itself raises ``MemoryError``,
  as allocating a record buffer can: the tier's contract does not cover it, the store's
  boundary must).

REMOTE faults (:data:`REMOTE_FAULTS`, ops ``lookup``, ``get``, ``put``) are in
:mod:`kvtier.testing.remote`: :class:`~kvtier.testing.remote.MemoryRemote` and
:func:`~kvtier.testing.remote.inject_remote_faults`.

:func:`abandon` simulates a crash of the process that owns a store (see its docstring for
what it does and does not model); the crash tests kill real processes with SIGKILL.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from kvtier.records import HEADER_NBYTES

DISK_READ_FAULTS = ("error", "readers_full", "corrupt", "truncate", "missing", "delay")
DISK_WRITE_FAULTS = ("full", "error", "enospc", "corrupt", "delay", "raise")
REMOTE_FAULTS = {  # used by kvtier.testing.remote
    "lookup": ("unavailable", "timeout", "delay", "raise"),
    "get": ("unavailable", "timeout", "corrupt", "truncate", "missing", "delay", "raise"),
    "put": ("full", "unavailable", "timeout", "corrupt", "truncate", "delay", "raise"),
}
_KINDS = {"read": DISK_READ_FAULTS, "write": DISK_WRITE_FAULTS, **REMOTE_FAULTS}


@dataclass(frozen=True)
class Fault:
    """One fault rule.

    Attributes:
        op: ``"read"``/``"write"`` (DISK) or ``"lookup"``/``"get"``/``"put"`` (REMOTE).
        kind: what goes wrong (module doc; ``_KINDS[op]`` lists the valid ones).
        p: probability that a call of ``op`` fires this fault (seeded by the plan).
        calls: 1-based numbers of the calls of ``op`` that fire it (scripted); ``None``: any
            call, with probability ``p``.
        keys: only calls on these blocks (block hashes) can fire it; ``None``: any block.
        delay_s: seconds of ``delay`` (and of ``timeout`` on REMOTE, capped at the timeout).
        max_times: fire at most this often; ``None``: no limit.

    Raises:
        ValueError: an unknown op or kind, ``p`` outside [0, 1].
    """

    op: str
    kind: str
    p: float = 1.0
    calls: frozenset[int] | None = None
    keys: frozenset[bytes] | None = None
    delay_s: float = 0.02
    max_times: int | None = None

    def __post_init__(self) -> None:
        if self.op not in _KINDS:
            raise ValueError(f"expected op in {sorted(_KINDS)}, got {self.op!r}")
        if self.kind not in _KINDS[self.op]:
            raise ValueError(f"expected a {self.op} fault in {_KINDS[self.op]}, got {self.kind!r}")
        if not 0.0 <= self.p <= 1.0:
            raise ValueError(f"expected 0 <= p <= 1, got {self.p!r}")
        for name in ("calls", "keys"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, frozenset(getattr(self, name)))


@dataclass(frozen=True)
class Injection:
    """A fault that fired: the ``call``-th call of ``op`` got ``kind`` (on block ``key``)."""

    op: str
    call: int
    kind: str
    key: bytes | None = None


@dataclass(frozen=True)
class Hit:
    """A fault that fires on one call: the rule, the call number of its op, and a random
    generator for the damage (which bit, how short)."""

    fault: Fault
    call: int
    rng: random.Random


class FaultPlan:
    """Decides which calls fail and logs what fired. Thread-safe.

    A call that names its block (``key``: DISK reads and writes, REMOTE gets and puts) draws
    from a generator seeded by ``(seed, op, key, how often this key was seen)``, so which
    calls fail does not depend on how threads interleave (a hypothesis test replays it
    exactly); calls without a key draw from one seeded generator.

    Args:
        faults: the rules; the first rule of an op that fires wins.
        seed: seeds the per-call draws and the damaged byte positions.
    """

    def __init__(self, faults: Iterable[Fault] = (), seed: int = 0) -> None:
        self.faults: list[Fault] = list(faults)
        self.seed = seed
        self.injected: list[Injection] = []
        self._rng = random.Random(seed)
        self._calls: Counter = Counter()
        self._seen: Counter = Counter()  # (op, key) -> calls
        self._fired: Counter = Counter()
        self._paused = 0
        self._lock = threading.Lock()

    def pick(self, op: str, key: bytes | None = None) -> Hit | None:
        """Count a call of ``op`` (on block ``key``); the fault that fires on it, or ``None``."""
        with self._lock:
            if self._paused:
                return None
            self._calls[op] += 1
            call = self._calls[op]
            if key is None:
                rng = random.Random(self._rng.getrandbits(64))
            else:
                self._seen[op, bytes(key)] += 1
                digest = hashlib.blake2b(repr((self.seed, op, self._seen[op, bytes(key)])).encode() + bytes(key))
                rng = random.Random(int.from_bytes(digest.digest()[:8], "little"))
            draw = rng.random()
            for i, fault in enumerate(self.faults):
                if fault.op != op or (fault.max_times is not None and self._fired[i] >= fault.max_times):
                    continue
                if fault.keys is not None and (key is None or bytes(key) not in fault.keys):
                    continue
                if (call in fault.calls) if fault.calls is not None else draw < fault.p:
                    self._fired[i] += 1
                    return Hit(fault, call, rng)
            return None

    def record(self, hit: Hit, key: bytes | None = None, kind: str | None = None) -> None:
        """Log that ``hit`` took effect (as ``kind``, default its fault's kind)."""
        with self._lock:
            key = None if key is None else bytes(key)
            self.injected.append(Injection(hit.fault.op, hit.call, kind or hit.fault.kind, key))

    def calls(self, op: str) -> int:
        """Calls of ``op`` seen so far (paused calls not counted)."""
        return self._calls[op]

    def count(self, op: str | None = None, kind: str | None = None) -> int:
        return sum(1 for i in self.injected if op in (None, i.op) and kind in (None, i.kind))

    def keys(self, op: str | None = None, kind: str | None = None) -> set[bytes]:
        """Blocks a fired fault touched (``key`` set)."""
        return {i.key for i in self.injected if i.key is not None and op in (None, i.op) and kind in (None, i.kind)}

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No fault fires (and no call is counted) inside; for a test's own checks."""
        with self._lock:
            self._paused += 1
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1


# -- damage ----------------------------------------------------------------------------------
def flip_bit(value: bytes | memoryview, rng: random.Random, start: int = 0) -> bytes:
    """A copy of ``value`` with one bit flipped at a random offset >= ``start``."""
    data = bytearray(value)
    if len(data) > start:
        data[start + rng.randrange(len(data) - start)] ^= 1 << rng.randrange(8)
    return bytes(data)


def truncate(value: bytes | memoryview, rng: random.Random) -> bytes:
    """A copy of ``value`` cut to a random shorter length (possibly 0)."""
    return bytes(value[: rng.randrange(max(1, len(value)))])


# -- DISK ------------------------------------------------------------------------------------
class _DiskFaults:
    """The injected state of one DiskTier: the plan and the write fault of the current call."""

    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan
        self.local = threading.local()  # .write: (Hit, index of the put to damage) or None

    def current_write(self):
        return getattr(self.local, "write", None)


class _FaultyTxn:
    """An LMDB transaction whose ``get`` (reads; in read transactions only) and ``put``
    (writes) misbehave per the plan. A write transaction's ``get`` is the writer reading back
    the value it just put (``put_record`` writes the header into it): not a block read, and
    a damaged copy there would commit a record whose header never got written."""

    def __init__(self, txn, faults: _DiskFaults, write: bool = False) -> None:
        self._txn, self._faults, self._puts, self._write = txn, faults, 0, write

    def __enter__(self) -> "_FaultyTxn":
        self._txn.__enter__()
        return self

    def __exit__(self, *exc: object):
        return self._txn.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._txn, name)

    def get(self, key, default=None, *args, **kwargs):
        import lmdb

        hit = None if self._write else self._faults.plan.pick("read", bytes(key))
        if hit is None:
            return self._txn.get(key, default, *args, **kwargs)
        fault = hit.fault
        self._faults.plan.record(hit, key)
        if fault.kind == "error":
            raise lmdb.DiskError("injected: read I/O error")
        if fault.kind == "readers_full":
            raise lmdb.ReadersFullError("injected: MDB_READERS_FULL")
        if fault.kind == "missing":
            return default
        if fault.kind == "delay":
            time.sleep(fault.delay_s)
        value = self._txn.get(key, default, *args, **kwargs)
        if value is None or fault.kind == "delay":
            return value
        damage = flip_bit if fault.kind == "corrupt" else truncate
        return memoryview(damage(value, hit.rng))

    def put(self, key, value, *args, **kwargs):
        import lmdb

        write = self._faults.current_write()
        index, self._puts = self._puts, self._puts + 1
        if write is not None:
            hit, target = write
            kind = hit.fault.kind
            if kind in ("full", "error"):
                self._faults.plan.record(hit, key)
                raise (lmdb.MapFullError if kind == "full" else lmdb.DiskError)(f"injected: {kind}")
            if kind == "corrupt" and index == target:
                self._faults.plan.record(hit, key)
                value = flip_bit(value, hit.rng, start=HEADER_NBYTES)  # header intact: at-rest payload rot
        return self._txn.put(key, value, *args, **kwargs)


class _FaultyEnv:
    """An LMDB environment whose transactions are :class:`_FaultyTxn`."""

    def __init__(self, env, faults: _DiskFaults) -> None:
        self.real, self._faults = env, faults

    def begin(self, *args, **kwargs) -> _FaultyTxn:
        return _FaultyTxn(self.real.begin(*args, **kwargs), self._faults, bool(kwargs.get("write", False)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def _disk_of(target):
    disk = getattr(target, "disk", target)
    if disk is None or not hasattr(disk, "write_batch"):
        raise ValueError(f"expected a TieredStore with a DISK tier or a DiskTier, got {type(target).__name__}")
    return disk


@contextlib.contextmanager
def inject_disk_faults(target, plan: FaultPlan) -> Iterator[FaultPlan]:
    """Make a DISK tier misbehave per ``plan`` inside the ``with`` block.

    Args:
        target: a :class:`~kvtier.store.TieredStore` (its ``disk``) or a
            :class:`~kvtier.tiers.disk.DiskTier`. The store's transfer handlers share the
            tier object, so every path (spills, write-through jobs, prefetch reads) sees the
            faults.
        plan: the faults (ops ``"read"`` and ``"write"``).

    Yields:
        ``plan``. On exit the tier is restored (unless it was closed meanwhile).

    Raises:
        ValueError: ``target`` has no DISK tier.
    """
    disk = _disk_of(target)
    faults = _DiskFaults(plan)
    real_env = disk.env
    real_write_batch = disk.write_batch  # bound method of the class
    real_has_room = disk._filesystem_has_room

    def write_batch(puts=(), deletes=(), evicted=True, after_put=None):
        hit = plan.pick("write", puts[0][0]) if puts else None
        if hit is not None:
            if hit.fault.kind == "raise":
                plan.record(hit, puts[0][0])
                raise MemoryError("injected: cannot allocate a record buffer")
            if hit.fault.kind == "delay":
                plan.record(hit, puts[0][0])
                time.sleep(hit.fault.delay_s)
                hit = None
        faults.local.write = None if hit is None else (hit, hit.rng.randrange(len(puts)))
        try:
            return real_write_batch(puts, deletes, evicted, after_put)
        finally:
            faults.local.write = None

    def filesystem_has_room(nbytes: int) -> bool:
        write = faults.current_write()
        if write is not None and write[0].fault.kind == "enospc":
            plan.record(write[0])
            return False
        return real_has_room(nbytes)

    disk.env = _FaultyEnv(real_env, faults)
    disk.write_batch = write_batch
    disk._filesystem_has_room = filesystem_has_room
    try:
        yield plan
    finally:
        del disk.write_batch, disk._filesystem_has_room  # the class's methods again
        if isinstance(disk.env, _FaultyEnv):
            disk.env = real_env


def abandon(store) -> None:
    """Simulate a crash of the process that owns ``store``, right after its last call
    returned: GPU/CPU contents are lost, the DISK keeps exactly the LMDB transactions that
    committed, nothing is flushed or fsynced, and the data directory's lock is released so
    it can be reopened. Background (write-through) DISK jobs already submitted are let
    finish first (a crash just after them); a kill in the middle of a transaction is what
    tests/reliability/test_crash.py does with real SIGKILLs. The abandoned object must not be
    used again (it raises ``RuntimeError("store is closed")``).
    """
    with store.residency.lock:
        store._closed = True
        store._executor.shutdown(wait=True)
        disk = store.disk
        if disk is not None and disk.env is not None:
            env = disk.env.real if isinstance(disk.env, _FaultyEnv) else disk.env
            env.close()  # unmaps without a sync: committed pages stay in the page cache, as after kill -9
            disk.env = None
            disk.abandon_handles()
            disk._lock_file.close()
