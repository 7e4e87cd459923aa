"""An in-memory REMOTE backend with injectable faults, and fault injection for any REMOTE
backend (the daemon's client, Redis). See :mod:`kvtier.testing.faults` for plans and rules.

Faults follow the contract of :mod:`kvtier.tiers.backend`: a remote-side problem is a status
or ``False``, counted in ``errors``; ``raise`` breaks the contract on purpose (a backend bug)
to test the store's boundary.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter, OrderedDict
from typing import Iterator, Sequence

import torch

from kvtier.checks import check_block_hashes, check_fingerprints, check_namespace, expected_fingerprints
from kvtier.records import HEADER_NBYTES, ReadStatus, decode_into, encode_record
from kvtier.testing.faults import FaultPlan, Hit, flip_bit, truncate
from kvtier.types import NO_FINGERPRINT, BlockHash, KVSpec


class MemoryRemote:
    """An in-memory REMOTE backend (:class:`kvtier.tiers.backend.RemoteBackend`) for tests.

    Values are real block records (:func:`kvtier.records.encode_record`) keyed by
    ``(namespace, block_hash)`` and verified on every read (:func:`kvtier.records.decode_into`),
    as the daemon and Redis backends do; faults come from ``plan`` (ops ``lookup``, ``get``,
    ``put``; kinds in :data:`REMOTE_FAULTS`; ``get`` and ``put`` draw once per block).

    Args:
        capacity_blocks: most records held; ``None``: unbounded.
        evict: when full, evict the least recently used record (``True``) or refuse the put.
        plan: the faults; ``None``: none.
        timeout_s: a ``timeout`` fault waits ``min(fault.delay_s, timeout_s)`` seconds.
    """

    def __init__(
        self, capacity_blocks: int | None = None, evict: bool = True, plan: FaultPlan | None = None,
        timeout_s: float = 2.0,
    ) -> None:
        self.capacity_blocks, self.evict, self.timeout_s = capacity_blocks, evict, timeout_s
        self.plan = plan or FaultPlan()
        self.errors: Counter = Counter()
        self.specs: dict[bytes, KVSpec] = {}
        self.records: OrderedDict[tuple[bytes, bytes], bytes] = OrderedDict()  # LRU order
        self.calls: Counter = Counter()
        self._lock = threading.Lock()
        self._closed = False

    # -- the contract ------------------------------------------------------------------------
    def register(self, namespace: bytes, spec: KVSpec) -> None:
        check_namespace(namespace)
        with self._lock:
            known = self.specs.setdefault(namespace, spec)
        if known != spec:
            raise ValueError(f"expected namespace {namespace.hex()[:16]} with {known}, got {spec}")

    def lookup(self, namespace: bytes, block_hashes: Sequence[BlockHash]) -> int:
        check_namespace(namespace)
        check_block_hashes(block_hashes)
        self.calls["lookup"] += 1
        hit = self.plan.pick("lookup")
        if hit is not None and self._fault_ends_call(hit, None) is not None:
            return 0
        with self._lock:
            n = 0
            for h in block_hashes:
                if (namespace, bytes(h)) not in self.records:
                    break
                n += 1
            return n

    def get_into(
        self, namespace: bytes, block_hashes: Sequence[BlockHash], outs: Sequence[torch.Tensor],
        fingerprints: Sequence[bytes | None] | None = None,
    ) -> list[ReadStatus]:
        check_namespace(namespace)
        check_block_hashes(block_hashes)
        expected = expected_fingerprints(fingerprints, len(block_hashes))
        if len(outs) != len(block_hashes):
            raise ValueError(f"expected one out tensor per block hash, got {len(outs)} for {len(block_hashes)}")
        self.calls["get"] += 1
        statuses: list[ReadStatus] = []
        for h, out, fingerprint in zip(block_hashes, outs, expected):
            status = self._get_one(namespace, bytes(h), out, fingerprint)
            statuses.append(status)
            if status is not ReadStatus.OK:
                rest = ReadStatus.UNAVAILABLE if status is ReadStatus.UNAVAILABLE else ReadStatus.MISSING
                statuses += [rest] * (len(block_hashes) - len(statuses))
                break
        return statuses

    def put(
        self, namespace: bytes, block_hashes: Sequence[BlockHash], blocks: Sequence[torch.Tensor],
        fingerprints: Sequence[bytes] | None = None,
    ) -> list[bool]:
        check_namespace(namespace)
        check_block_hashes(block_hashes)
        fps = check_fingerprints(fingerprints, len(block_hashes)) or [NO_FINGERPRINT] * len(block_hashes)
        if len(blocks) != len(block_hashes):
            raise ValueError(f"expected one block per block hash, got {len(blocks)} for {len(block_hashes)}")
        self.calls["put"] += 1
        ok: list[bool] = []
        for h, block, fingerprint in zip(block_hashes, blocks, fps):
            if not isinstance(block, torch.Tensor) or block.device.type != "cpu" or not block.is_contiguous():
                raise TypeError(f"expected contiguous CPU tensors, got {type(block).__name__}")
            stored, go_on = self._put_one(namespace, bytes(h), block, fingerprint)
            ok.append(stored)
            if not go_on:
                ok += [False] * (len(block_hashes) - len(ok))
                break
        return ok

    def clear_namespace(self, namespace: bytes) -> int:
        """Delete every record of ``namespace`` (it stays registered); returns how many."""
        check_namespace(namespace)
        with self._lock:
            keys = [key for key in self.records if key[0] == namespace]
            for key in keys:
                del self.records[key]
        return len(keys)

    def close(self) -> None:
        self._closed = True

    # -- helpers -------------------------------------------------------------------------------
    def _fault_ends_call(self, hit: Hit, key: bytes | None) -> ReadStatus | None:
        """Apply a call-level fault: ``raise``, sleep, count; the status it ends the call with
        (``None`` when the call goes on: ``delay``, or a byte-level kind for the caller)."""
        fault = hit.fault
        self.plan.record(hit, key)
        if fault.kind == "raise":
            raise ConnectionError(f"injected: {fault.op} failed")
        if fault.kind in ("delay", "timeout"):
            time.sleep(min(fault.delay_s, self.timeout_s) if fault.kind == "timeout" else fault.delay_s)
        if fault.kind in ("unavailable", "timeout"):
            self.errors[fault.kind] += 1
            return ReadStatus.UNAVAILABLE if fault.kind == "unavailable" else ReadStatus.TIMEOUT
        if fault.kind == "missing":
            return ReadStatus.MISSING
        return None

    def _get_one(self, namespace: bytes, h: bytes, out: torch.Tensor, fingerprint: bytes | None) -> ReadStatus:
        hit = self.plan.pick("get", h)
        if hit is not None:
            status = self._fault_ends_call(hit, h)
            if status is not None:
                return status
        with self._lock:
            value = self.records.get((namespace, h))
            if value is not None:
                self.records.move_to_end((namespace, h))
        if value is None:
            return ReadStatus.MISSING
        if hit is not None and hit.fault.kind in ("corrupt", "truncate"):
            value = flip_bit(value, hit.rng) if hit.fault.kind == "corrupt" else truncate(value, hit.rng)
        status = decode_into(memoryview(value), namespace, out, fingerprint)
        if status is not ReadStatus.OK:
            self.errors[status.value] += 1
        return status

    def _put_one(self, namespace: bytes, h: bytes, block: torch.Tensor, fingerprint: bytes) -> tuple[bool, bool]:
        """``(stored, go on with the next block)``."""
        hit = self.plan.pick("put", h)
        kind = None
        if hit is not None:
            kind = hit.fault.kind
            if kind == "full":
                self.plan.record(hit, h)
                self.errors["full"] += 1
                return False, True
            if self._fault_ends_call(hit, h) is not None:
                return False, False
        value = bytes(encode_record(namespace, block.contiguous(), 0, fingerprint).data)
        if kind == "corrupt":
            value = flip_bit(value, hit.rng, start=HEADER_NBYTES)
        elif kind == "truncate":
            value = truncate(value, hit.rng)
        with self._lock:
            key = (namespace, h)
            if key in self.records:  # idempotent: a block present stays as it is
                self.records.move_to_end(key)
                return True, True
            if self.capacity_blocks is not None and len(self.records) >= self.capacity_blocks:
                if not self.evict or not self.records:
                    self.errors["full"] += 1
                    return False, True
                self.records.popitem(last=False)
            self.records[key] = value
        return True, True


_BYTE_LEVEL = {"corrupt", "truncate"}


@contextlib.contextmanager
def inject_remote_faults(target, plan: FaultPlan) -> Iterator[FaultPlan]:
    """Make a REMOTE backend misbehave per ``plan`` inside the ``with`` block.

    Args:
        target: a backend, or a store holding one as ``.remote``. A :class:`MemoryRemote`
            takes every kind (its ``plan`` is swapped); any other backend (the daemon's
            client, Redis) is wrapped per instance and takes the kinds that need no access to
            its raw values (``unavailable``, ``timeout``, ``delay``, ``raise``, ``missing``,
            ``full``); to serve damaged bytes through a real daemon, damage its store.
        plan: the faults (ops ``lookup``, ``get``, ``put``).

    Raises:
        ValueError: no backend, or a byte-level fault for a backend that is not a MemoryRemote.
    """
    backend = getattr(target, "remote", target)
    if backend is None or not hasattr(backend, "get_into"):
        raise ValueError(f"expected a REMOTE backend or a store with one, got {type(target).__name__}")
    if isinstance(backend, MemoryRemote):
        saved, backend.plan = backend.plan, plan
        try:
            yield plan
        finally:
            backend.plan = saved
        return
    if any(f.kind in _BYTE_LEVEL for f in plan.faults):
        raise ValueError("expected corrupt/truncate faults only on a MemoryRemote (no access to raw values)")
    wrappers = _remote_wrappers(backend, plan)
    for name, fn in wrappers.items():
        setattr(backend, name, fn)
    try:
        yield plan
    finally:
        for name in wrappers:
            delattr(backend, name)


def _remote_wrappers(backend, plan: FaultPlan) -> dict:
    real_lookup, real_get, real_put = backend.lookup, backend.get_into, backend.put

    def call_fault(op: str) -> Hit | None:
        hit = plan.pick(op)
        if hit is None:
            return None
        fault = hit.fault
        plan.record(hit)
        if fault.kind == "raise":
            raise ConnectionError(f"injected: {op} failed")
        if fault.kind in ("delay", "timeout"):
            time.sleep(fault.delay_s)
        if fault.kind in ("unavailable", "timeout"):
            backend.errors[fault.kind] += 1
        return None if fault.kind == "delay" else hit

    def lookup(namespace, block_hashes):
        return 0 if call_fault("lookup") else real_lookup(namespace, block_hashes)

    def get_into(namespace, block_hashes, outs, fingerprints=None):
        hit = call_fault("get")
        if hit is None:
            return real_get(namespace, block_hashes, outs, fingerprints)
        by_kind = {"unavailable": ReadStatus.UNAVAILABLE, "timeout": ReadStatus.TIMEOUT}
        status = by_kind.get(hit.fault.kind, ReadStatus.MISSING)
        rest = ReadStatus.UNAVAILABLE if status is ReadStatus.UNAVAILABLE else ReadStatus.MISSING
        return [status] + [rest] * (len(block_hashes) - 1) if block_hashes else []

    def put(namespace, block_hashes, blocks, fingerprints=None):
        return [False] * len(block_hashes) if call_fault("put") else real_put(namespace, block_hashes, blocks, fingerprints)

    return {"lookup": lookup, "get_into": get_into, "put": put}
