"""The block record: kvtier's one on-disk and on-the-wire format for a block.

A record is a 128-byte header followed by the raw block bytes::

    magic "KVTB" | version u16 | dtype code u8 | ndim u8 | shape 8 x u32 | namespace 32 B |
    fingerprint 32 B | payload_nbytes u64 | seq u64 |
    checksum u64 (xxh3-64 over the header before it + the payload's own xxh3-64, u64 LE)

The DISK tier stores records as LMDB values, the daemon sends and receives them, Redis holds
them as values. Every reader verifies magic, version, namespace, dtype, shape, size and the
checksum before a byte reaches the caller (:func:`decode_into`); anything else is ``CORRUPT``
and is never served (case D1). ``fingerprint`` is the token fingerprint of the block
(:mod:`kvtier.hashing`); a reader that knows the request's tokens passes its expected
fingerprint, and a record whose fingerprint differs is ``TOKEN_MISMATCH``: intact, but
computed from other tokens, never served. ``seq`` is the writer's store sequence (DISK uses
it to rebuild LRU order); other writers may leave it 0.

The checksum hashes the payload's digest, not the payload after the header fields: a block's
payload digest is computed once, where its bytes are already being read (copied into a pool
slot by ``TieredStore.store``, received by the daemon), kept beside its slot
(:meth:`kvtier.tiers.pool.BlockPool.payload_digest_at`), and every record later made of that
slot (its DISK spill, each daemon get) hashes 128 bytes instead of the block again (issue 17:
a store into a full CPU slab hashed every victim from DRAM while LMDB copied the one before;
bench/results/2026-12-04-payload-digest). A digest kept for bytes that changed since makes a
record that fails its checksum on read (``CORRUPT``, a miss), never one served wrong.

Versions: version 2 added the fingerprint (version 1 was the 96-byte header without it);
version 3 hashes the payload's digest into the checksum (version 2 hashed the header fields,
then the payload, in one stream). A record of another version is not corrupt: it is another release's, and is a miss
(``OTHER_VERSION``; :func:`record_version` tells it apart from garbage) that the tiers leave
to age out rather than delete (a process of another release may share the DISK directory
or the REMOTE tier).
"""

from __future__ import annotations

import enum
import math
import struct
from typing import NamedTuple

import numpy as np
import torch
import xxhash

from kvtier.kernels import host_copy
from kvtier.types import DTYPE_NAMES, DTYPES_BY_NAME, NO_FINGERPRINT

_MAGIC = b"KVTB"
VERSION = 3
_HEADER = struct.Struct("<4sHBB8I32s32sQQ")  # everything but the trailing checksum
_CHECKSUM = struct.Struct("<Q")
_MAGIC_VERSION = struct.Struct("<4sH")
HEADER_NBYTES = _HEADER.size + _CHECKSUM.size  # 128
_DTYPE_CODES = {name: i + 1 for i, name in enumerate(sorted(DTYPE_NAMES.values()))}
_DTYPE_BY_CODE = {code: name for name, code in _DTYPE_CODES.items()}
_DIGEST = struct.Struct("<Q")  # a payload's xxh3-64, as the checksum hashes it
_CHUNK_NBYTES = 512 << 10  # encode_record's copy+hash granularity (into its own buffer, not a file mapping),
# so the hash reads the destination from cache
_READ_CHUNK_NBYTES = 4 << 20
"""A contiguous destination's granularity without the fused kernel (:func:`decode_into_view`):
each piece of the payload is hashed where it lies in LMDB's map, then copied from cache
(:func:`kvtier.kernels.host_copy.copy_rows`: streaming stores; one numpy ``copyto`` without the
compiled kernels). Pieces of up to 4 MiB (within L3), not the
512 KiB pieces copied first and hashed from the destination as before: glibc's ``memmove``
uses ``rep movsb`` for copies from 8 KiB up to the L2 size on AMD cores (glibc 2.33+,
``rep_movsb_stop_threshold``), and from a file mapping's 4 KiB pages that ran at 5.3 GB/s where
2 MiB copies ran at 10.3 GB/s (2026-12-03 VM: AMD EPYC, 1 MiB L2, glibc 2.36;
bench/results/2026-12-03-disk-read/micro/micro.log). Hash-then-copy vs the old order, one
thread, warm: 2 MiB blocks 10.95 vs 5.85 GB/s, 720 KiB blocks 5.34 vs 4.53 GB/s (same log)."""


class ReadStatus(enum.Enum):
    """Outcome of reading one block from DISK, the daemon or Redis."""

    OK = "ok"
    MISSING = "missing"
    CORRUPT = "corrupt"
    TIMEOUT = "timeout"
    UNAVAILABLE = "unavailable"  # backend down, connection refused, protocol error
    TOKEN_MISMATCH = "token_mismatch"  # intact, but its fingerprint is not the request's
    OTHER_VERSION = "other_version"  # a record of another format version (another release)


def record_nbytes(payload_nbytes: int) -> int:
    """Bytes of a record whose block has ``payload_nbytes`` bytes."""
    return HEADER_NBYTES + payload_nbytes


def _pack_header(namespace: bytes, block: torch.Tensor, seq: int, fingerprint: bytes) -> bytes:
    """The header's fields before the checksum (``_HEADER.size`` bytes)."""
    assert block.is_contiguous() and block.device.type == "cpu", "block must be contiguous on CPU"
    shape = list(block.shape)
    assert len(shape) <= 8 and len(namespace) == 32 and len(fingerprint) == 32
    return _HEADER.pack(
        _MAGIC, VERSION, _DTYPE_CODES[DTYPE_NAMES[block.dtype]], len(shape),
        *(shape + [0] * (8 - len(shape))), namespace, fingerprint, block.numel() * block.element_size(), seq,
    )


def payload_digest(block: torch.Tensor) -> int:
    """The xxh3-64 of ``block``'s bytes (a contiguous CPU tensor): what a record's checksum
    hashes in place of the payload (:func:`record_checksum`)."""
    assert block.is_contiguous() and block.device.type == "cpu", "block must be contiguous on CPU"
    return xxhash.xxh3_64_intdigest(block.view(torch.uint8).numpy().reshape(-1)) if block.numel() else _EMPTY_DIGEST


def record_checksum(header: bytes | memoryview | np.ndarray, digest: int) -> int:
    """The checksum of a record whose header starts with ``header`` (at least the
    ``_HEADER.size`` bytes before the checksum; more are ignored) and whose payload's
    xxh3-64 is ``digest``."""
    return xxhash.xxh3_64_intdigest(bytes(header[: _HEADER.size]) + _DIGEST.pack(digest))


_EMPTY_DIGEST = xxhash.xxh3_64_intdigest(b"")


class RecordDigest:
    """A record's checksum computed as its payload arrives (:meth:`RecordHeader.digest`):
    ``update`` with the payload's bytes in order; ``intdigest()`` is the record's checksum,
    ``payload_intdigest()`` the payload's own xxh3-64 (kept beside a pool slot:
    :meth:`kvtier.tiers.pool.BlockPool.set_payload_digest`)."""

    __slots__ = ("_header", "_payload", "update")

    def __init__(self, header: bytes | memoryview) -> None:
        self._header = bytes(header[: _HEADER.size])
        self._payload = xxhash.xxh3_64()
        self.update = self._payload.update

    def payload_intdigest(self) -> int:
        return self._payload.intdigest()

    def intdigest(self) -> int:
        return record_checksum(self._header, self._payload.intdigest())


def encode_record(namespace: bytes, block: torch.Tensor, seq: int, fingerprint: bytes = NO_FINGERPRINT) -> np.ndarray:
    """Header + checksum + payload in one new buffer: one copy of the block, hashed chunk by
    chunk from the buffer while it is hot. ``fingerprint``: the block's token fingerprint
    (32 bytes)."""
    header = _pack_header(namespace, block, seq, fingerprint)
    payload_nbytes = block.numel() * block.element_size()
    record = np.empty(HEADER_NBYTES + payload_nbytes, dtype=np.uint8)
    record[: _HEADER.size] = np.frombuffer(header, dtype=np.uint8)
    digest = xxhash.xxh3_64()
    if payload_nbytes:
        src = block.view(torch.uint8).numpy().reshape(-1)
        dst = record[HEADER_NBYTES:]
        for start in range(0, payload_nbytes, _CHUNK_NBYTES):
            chunk = dst[start : start + _CHUNK_NBYTES]
            np.copyto(chunk, src[start : start + _CHUNK_NBYTES])
            digest.update(chunk)
    checksum = record_checksum(header, digest.intdigest())
    record[_HEADER.size : HEADER_NBYTES] = np.frombuffer(_CHECKSUM.pack(checksum), dtype=np.uint8)
    return record


def encode_header(
    namespace: bytes, block: torch.Tensor, seq: int = 0, fingerprint: bytes = NO_FINGERPRINT, digest: int | None = None,
) -> bytes:
    """The 128-byte header (checksum included) of ``block``'s record, hashing the block in
    place: ``encode_header(ns, block, seq, fp) + block bytes == encode_record(ns, block, seq,
    fp)``, so a sender can write the header and then the block's own memory, with no record
    copy.

    Args:
        namespace: 32 bytes.
        block: contiguous CPU tensor of one block, any shape of up to 8 dims, a dtype of
            :data:`kvtier.types.DTYPE_NAMES`.
        seq: the writer's store sequence (0: none).
        fingerprint: the block's token fingerprint, 32 bytes.
        digest: the block's :func:`payload_digest`, when known (a pool slot's
            :meth:`~kvtier.tiers.pool.BlockPool.payload_digest_at`): the block is not read.
            A digest of other bytes makes a record that reads back ``CORRUPT``.
    """
    header = _pack_header(namespace, block, seq, fingerprint)
    if digest is None:
        digest = payload_digest(block)
    return header + _CHECKSUM.pack(record_checksum(header, digest))


# -- reading -----------------------------------------------------------------------------------
class RecordHeader(NamedTuple):
    """The fields of a record header that passed :func:`parse_header` (a tuple: made on
    every read, cheaply)."""

    dtype: str
    shape: tuple[int, ...]
    namespace: bytes
    fingerprint: bytes
    payload_nbytes: int
    seq: int
    checksum: int

    def digest(self, header: bytes | memoryview) -> RecordDigest:
        """The record's checksum to be computed (:class:`RecordDigest`, of ``header``: this
        record's 128 header bytes): feed it the payload in order with ``update``; the record
        is intact iff ``intdigest()`` then equals ``checksum``."""
        return RecordDigest(header)


def parse_header(header: bytes | memoryview, record_nbytes: int | None = None) -> RecordHeader | None:
    """The fields of a record's 128-byte header (the record's first bytes), or ``None`` when
    they are not a consistent kvtier header of this version (:data:`VERSION`; see
    :func:`record_version` for another version's): magic, version, dtype code, ndim, a payload size
    that is not ``prod(shape) * itemsize``, a sequence out of range, or (given
    ``record_nbytes``, the whole record's length) a payload size that does not add up to it.
    A corrupt size or sequence must not skew accounting or order.

    The one header parser: DISK's index rebuild and every read (:func:`decode_into`) and the
    daemon's streams (read before the payload arrives). The caller compares namespace, dtype
    and shape with what it expects, then verifies the payload with :meth:`RecordHeader.digest`.
    """
    if len(header) < HEADER_NBYTES:
        return None
    magic, version, dtype_code, ndim, *rest = _HEADER.unpack_from(header)
    shape, namespace, fingerprint, payload_nbytes, seq = rest[:8], rest[8], rest[9], rest[10], rest[11]
    if magic != _MAGIC or version != VERSION or dtype_code not in _DTYPE_BY_CODE or not 0 < ndim <= 8:
        return None
    dtype = _DTYPE_BY_CODE[dtype_code]
    if payload_nbytes != math.prod(shape[:ndim]) * DTYPES_BY_NAME[dtype].itemsize or seq >= 1 << 62:
        return None
    if record_nbytes is not None and record_nbytes != HEADER_NBYTES + payload_nbytes:
        return None
    (checksum,) = _CHECKSUM.unpack_from(header, _HEADER.size)
    return RecordHeader(dtype, tuple(shape[:ndim]), namespace, fingerprint, payload_nbytes, seq, checksum)


def record_version(value: bytes | memoryview) -> int | None:
    """The format version of a record (any release's: its first 6 bytes are magic and
    version in every version), or ``None`` when ``value`` does not start like a record."""
    if len(value) < _MAGIC_VERSION.size:
        return None
    magic, version = _MAGIC_VERSION.unpack_from(value)
    return version if magic == _MAGIC else None


def failed_header_status(value: bytes | memoryview) -> ReadStatus:
    """Why a header :func:`parse_header` refused is not served: ``OTHER_VERSION`` for a
    record of another version, else ``CORRUPT``."""
    version = record_version(value)
    return ReadStatus.OTHER_VERSION if version is not None and version != VERSION else ReadStatus.CORRUPT


def _header_for(value: memoryview, namespace: bytes, plan: tuple) -> "RecordHeader | ReadStatus":
    """The header of ``value`` if it is a record of ``namespace`` with the destination's dtype,
    shape and size (``plan``: :func:`_view_plan`); else the read's status (``CORRUPT``, or
    ``OTHER_VERSION`` for another format)."""
    record = parse_header(value, len(value))
    if record is None:
        return failed_header_status(value)
    dtype_name, shape, nbytes, _ = plan
    if record.namespace != namespace or record.dtype != dtype_name or record.shape != shape or record.payload_nbytes != nbytes:
        return ReadStatus.CORRUPT
    return record


def decode_into(value: memoryview, namespace: bytes, out: torch.Tensor, fingerprint: bytes | None = None) -> ReadStatus:
    """Verify the whole record ``value`` and copy its payload into ``out`` (a contiguous CPU
    tensor of the expected shape and dtype; :func:`decode_into_view` for any strides).

    Returns:
        ``OK`` iff header, namespace, dtype, shape, size and checksum all match and, given
        ``fingerprint`` (the request's), the record's fingerprint equals it;
        ``TOKEN_MISMATCH`` for an intact record of other tokens; ``OTHER_VERSION`` for a
        record of another format version; ``CORRUPT`` otherwise. Unless ``OK``, ``out`` may
        hold partial or other bytes: never use them.

    Raises:
        ValueError: ``out`` reaches past its storage (nothing written).
    """
    return decode_into_view(value, namespace, out, fingerprint)


def check_record(record: RecordHeader, checksum: int, fingerprint: bytes | None) -> ReadStatus:
    """The verdict on a record whose payload hashed to ``checksum``: ``CORRUPT`` if that is
    not the header's, else ``TOKEN_MISMATCH`` if ``fingerprint`` is given and is not the
    record's, else ``OK``. Checked after the payload, so a damaged fingerprint field is
    ``CORRUPT``, not a mismatch (the checksum covers it)."""
    if checksum != record.checksum:
        return ReadStatus.CORRUPT
    if fingerprint is not None and fingerprint != record.fingerprint:
        return ReadStatus.TOKEN_MISMATCH
    return ReadStatus.OK


_VIEW_PLANS: dict[tuple, tuple] = {}
"""``(dtype, shape, strides, device, negative or conjugate bit)`` of a destination -> what the
record decoders check and copy by: computed once per layout (a DISK hit reads tens of blocks
into places of one shape: 16.6 -> 10.6 us of Python a block, timeit of decode_into_view at
7ba885d)."""


def _view_plan(out: torch.Tensor) -> tuple[str | None, tuple[int, ...], int, tuple[int, int, int] | None]:
    """``(dtype name, shape, payload bytes, row layout or None)`` of a destination tensor; the
    layout only for plain host memory (a CPU tensor, not a negated or conjugated view)."""
    key = (out.dtype, out.shape, out.stride(), out.device, out.is_neg() or out.is_conj())
    plan = _VIEW_PLANS.get(key)
    if plan is None:
        layout = None
        if out.numel() and out.device.type == "cpu" and not (out.is_neg() or out.is_conj()):
            try:
                layout = host_copy.row_layout(out.view(torch.uint8).numpy())
            except (RuntimeError, TypeError):  # 0-d, a last dimension with stride != 1, ...: numpy's path decides
                layout = None
        plan = (DTYPE_NAMES.get(out.dtype), tuple(out.shape), out.numel() * out.element_size(), layout)
        if len(_VIEW_PLANS) >= 256:  # bounded: a process sees a few layouts
            _VIEW_PLANS.clear()
        _VIEW_PLANS[key] = plan
    return plan


def _check_storage(out: torch.Tensor, shift: int = 0) -> None:
    """Raise ``ValueError`` unless every element of ``out`` (moved by ``shift`` elements: a
    :class:`BlockPlaces` place) lies in its storage (a tensor whose storage was resized away
    must not be written through its address)."""
    storage = out.untyped_storage()
    itemsize = out.element_size()
    last = out.storage_offset() + shift + sum((n - 1) * st for n, st in zip(out.shape, out.stride()) if st > 0)
    if out.numel() and (last + 1) * itemsize > storage.nbytes():
        raise ValueError(f"expected a destination inside its storage ({storage.nbytes()} bytes), got one "
                         f"reaching byte {(last + 1) * itemsize}")


def decode_into_view(value: memoryview, namespace: bytes, out: torch.Tensor, fingerprint: bytes | None = None) -> ReadStatus:
    """:func:`decode_into` into a destination of any strides (a block's place in a larger
    buffer), in one pass over the payload where it lies in ``value``.

    With the compiled host kernels and python-xxhash's exported xxh3
    (:func:`kvtier.kernels.host_copy.hash_copy_rows`): each 64 KiB of the payload is hashed,
    then copied from cache into ``out``'s rows with streaming stores, in one C call that
    releases the GIL once per block (python-xxhash's hash, then the copy: two GIL round trips,
    each of which may wait for the other I/O thread or the caller). The reads of a 1k-token
    SmolLM2-135M prefix on a DISK hit's two I/O threads (64 blocks of 720 KiB, 32 a thread)
    took 4.4-6.8 ms with the kernel, 5.4-7.8 ms without it, one copy of the same bytes
    3.6-4.6 ms (two runs of four rounds on a noisy 2-core host,
    bench/results/2026-12-03-fused-hash/views.log). Otherwise the
    whole payload is hashed with python-xxhash (bringing it into cache: a block of
    SmolLM2-135M is 720 KiB, within L2), then copied from there (``copy_rows``; one strided
    numpy ``copyto`` without the kernels or for a place that is not evenly spaced rows); a
    contiguous ``out`` in pieces of :data:`_READ_CHUNK_NBYTES`. Either way the bytes
    delivered are the bytes hashed and memory is read once from DRAM.

    Args:
        value, namespace, fingerprint: as for :func:`decode_into` (``value`` must not
            change while this runs: an LMDB read transaction's snapshot).
        out: a CPU tensor of the record's shape and dtype, any strides.

    Returns:
        as :func:`decode_into`. Unless ``OK``, ``out`` may hold partial or other bytes:
        never use them.

    Raises:
        ValueError: ``out`` reaches past its storage (nothing written).
    """
    plan = _view_plan(out)
    record = _header_for(value, namespace, plan)
    if isinstance(record, ReadStatus):
        return record
    nbytes, rows = plan[2:]
    if not nbytes:
        return check_record(record, record.digest(value).intdigest(), fingerprint)
    src = np.frombuffer(value, dtype=np.uint8, offset=HEADER_NBYTES)
    if out.device.type == "cpu":
        _check_storage(out)
    plain = rows is not None  # plain host rows at out's address (_view_plan: no layout for a negated view)
    digest = host_copy.hash_copy_rows(out.data_ptr(), rows, src) if plain else None
    checksum = None if digest is None else record_checksum(value, digest)
    if checksum is None:  # without the kernels or python-xxhash's exported xxh3: hash, then copy from cache
        digest = record.digest(value)
        if plain and rows[0] == 1:  # contiguous: in pieces of _READ_CHUNK_NBYTES
            for start in range(0, nbytes, _READ_CHUNK_NBYTES):
                piece = src[start : start + _READ_CHUNK_NBYTES]
                digest.update(piece)
                if not host_copy.copy_rows(out.data_ptr() + start, (1, piece.size, piece.size), piece):
                    np.copyto(out.view(torch.uint8).numpy().reshape(-1)[start : start + piece.size], piece)
        else:
            digest.update(src)
            if not plain or not host_copy.copy_rows(out.data_ptr(), rows, src):
                dst = out.view(torch.uint8).numpy()  # the last dimension in bytes: same strides otherwise
                np.copyto(dst, src.reshape(dst.shape))
        checksum = digest.intdigest()
    return check_record(record, checksum, fingerprint)


class BlockPlaces:
    """Places of blocks in one buffer, equally spaced: place ``k`` is ``first`` moved by
    ``positions[k] * step`` elements (a DISK hit's blocks in the HF connector's hit buffer,
    ``kvtier.connectors.hf_cache.block_places``). A sequence of tensors (``places[k]`` is a view,
    made when asked for) that :func:`decode_into_places` writes without making one: a view costs
    ~3 us to make and ~3 us to drop, with the GIL, and a 4k-token SmolLM2-135M hit had 256.

    Args:
        first: block 0's place (a CPU tensor of the block's shape, any strides).
        step: elements between consecutive positions (> 0).
        positions: ``[n]`` ints >= 0, each place inside ``first``'s storage.

    Raises:
        ValueError: not a plain CPU tensor or one whose last dimension is strided, a step or
            position that is not a non-negative int, a place outside the storage, places that
            share bytes (duplicate positions, a step shorter than a place).
    """

    __slots__ = ("first", "step", "positions", "plan", "_itemsize")

    def __init__(self, first: torch.Tensor, step: int, positions: "list[int] | range", *, _checked: bool = False) -> None:
        self.first, self.step, self.positions = first, step, positions
        self.plan = _view_plan(first)
        self._itemsize = first.element_size()
        if _checked:
            return
        if first.device.type != "cpu" or first.is_neg() or first.is_conj():
            raise ValueError(f"expected a plain CPU tensor for block places, got {first.device} (neg {first.is_neg()})")
        if first.ndim and first.shape[-1] > 1 and first.stride(-1) != 1:
            raise ValueError(f"expected places whose last dimension is contiguous, got strides {first.stride()}")
        if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step <= 0:
            raise ValueError(f"expected a step > 0 (elements), got {step!r}")
        if any(not isinstance(p, (int, np.integer)) or isinstance(p, bool) or p < 0 for p in positions):
            raise ValueError("expected block positions to be ints >= 0")
        self.step = step = int(step)
        if not isinstance(positions, range):
            self.positions = positions = [int(p) for p in positions]
        if positions:
            _check_storage(first, max(positions) * step)
            self._check_apart()

    def _check_apart(self) -> None:
        """Raise ``ValueError`` unless the places are distinct and, for places of evenly spaced
        rows, none shares a byte with another (the hit buffer's places interleave: each one's
        rows fall in the others' gaps)."""
        offsets = sorted(p * self.step * self._itemsize for p in self.positions)
        gaps = [b - a for a, b in zip(offsets, offsets[1:])]
        if gaps and min(gaps) == 0:
            raise ValueError("expected distinct block positions")
        layout = self.plan[3]
        if layout is None or not gaps:
            return
        rows, row_nbytes, row_stride = layout
        apart = min(gaps) >= (rows - 1) * row_stride + row_nbytes  # whole places apart
        interleaved = min(gaps) >= row_nbytes and offsets[-1] - offsets[0] + row_nbytes <= row_stride
        if not (apart or interleaved):
            raise ValueError(f"expected block places that do not overlap, got a step of {self.step} elements for "
                             f"places of {rows} rows of {row_nbytes} bytes, {row_stride} apart")

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, k: int) -> torch.Tensor:
        first = self.first
        return first.as_strided(first.shape, first.stride(), first.storage_offset() + self.positions[k] * self.step)

    def subset(self, indices: "list[int]") -> "BlockPlaces":
        """The places ``indices`` of these, in that order."""
        return BlockPlaces(self.first, self.step, [self.positions[i] for i in indices], _checked=True)

    def addresses(self) -> np.ndarray:
        """``[n]`` int64: each place's address."""
        return self.first.data_ptr() + np.asarray(self.positions, dtype=np.int64) * (self.step * self._itemsize)


def decode_into_places(
    values: "list[memoryview | None]", namespace: bytes, places: BlockPlaces, fingerprints: "list[bytes | None]",
) -> list[ReadStatus]:
    """:func:`decode_into_view` of ``values[k]`` into ``places[k]`` for every ``k`` (``None``:
    ``MISSING``): headers checked here, then every intact-looking record hashed and copied in
    one call of :func:`kvtier.kernels.host_copy.hash_copy_blocks` (the GIL released once for all
    of them, no tensor view made); without it, one :func:`decode_into_view` a block.

    Args:
        values: ``[n]`` records (each must not change while this runs: one LMDB read
            transaction's snapshot), or ``None`` for a block not found.
        namespace: the store's.
        places: ``n`` places (:class:`BlockPlaces`), every block's shape and dtype.
        fingerprints: ``[n]`` the request's (``None``: not checked).

    Returns:
        ``[n]`` statuses, as :func:`decode_into`'s; a place whose status is not ``OK`` may
        hold partial or other bytes.
    """
    if len(values) != len(places) or len(fingerprints) != len(places):
        raise ValueError(f"expected one place and one fingerprint per value ({len(values)}), got "
                         f"{len(places)} and {len(fingerprints)}")
    statuses: list[ReadStatus] = [ReadStatus.MISSING] * len(values)
    plan = places.plan
    pending, records, arrays = [], [], []
    for k, value in enumerate(values):
        if value is None:
            continue
        record = _header_for(value, namespace, plan)
        if isinstance(record, ReadStatus):
            statuses[k] = record
            continue
        pending.append(k)
        records.append(record)
        arrays.append(np.frombuffer(value, dtype=np.uint8))
    if not pending:
        return statuses
    digests = None
    if plan[2] and plan[3] is not None:
        _check_storage(places.first, max(places.positions[k] for k in pending) * places.step)  # resized since?
        digests = host_copy.hash_copy_blocks(places.subset(pending).addresses(), plan[3], arrays, 0, HEADER_NBYTES)
    if digests is None:  # no kernels, no bound xxh3, or an empty payload: one block at a time
        for k in pending:
            statuses[k] = decode_into_view(values[k], namespace, places[k], fingerprints[k])
        return statuses
    for k, record, array, digest in zip(pending, records, arrays, digests.tolist()):
        statuses[k] = check_record(record, record_checksum(array, digest), fingerprints[k])
    return statuses
