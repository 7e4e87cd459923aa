"""GPU and CPU tiers: one preallocated pool tensor of fixed block slots, with exact LRU order.

The pool is allocated once at start-up (no per-block malloc on the hot path)::

    tensor: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], dtype of the model

and slot ``block_id`` holds one block; beside it the pool keeps the block's token fingerprint
(:mod:`kvtier.hashing`), which a load checks before the slot is served, and the xxh3-64 of its
bytes when whoever wrote them hashed them on the way (:meth:`BlockPool.payload_digest_at`:
every record later made of the slot, a DISK spill or a daemon get, then hashes its header only,
:mod:`kvtier.records`). On the CPU medium the tensor is pinned when CUDA is
available, so copies to and from the GPU are asynchronous DMA. A CPU pool's tensor starts one
page (:data:`FRAME_PAD_NBYTES`) into its allocation: every slot has memory before it, which
lets the DISK tier hand LMDB a slot framed as a whole record and copy it once
(:func:`kvtier.tiers.disk.put_record`).

A pool knows nothing of pins or of other tiers: the store decides what to evict (it skips
pinned blocks) and where a victim goes. Expected pressure is a return value:
:meth:`BlockPool.allocate` returns ``None`` when no slot is free (vLLM ``allocate_slots``).
"""

from __future__ import annotations

from typing import Iterator, Mapping, Sequence

import torch

from kvtier.tiers.host_memory import host_empty
from kvtier.tiers.lru import SegmentedLRU
from kvtier.types import NO_FINGERPRINT, BlockHash, Fingerprint, KVSpec, Medium

FRAME_PAD_NBYTES = 4096
"""Bytes a CPU pool allocates before slot 0 (a page: the slots keep the allocation's alignment); at least a
record header (:data:`kvtier.records.HEADER_NBYTES`, 128), so that slot 0 too can be framed as
a record by :func:`kvtier.tiers.disk.put_record`."""


class BlockPool:
    """Fixed-slot block pool on one device.

    Args:
        medium: ``Medium.GPU`` or ``Medium.CPU``.
        spec: block shape and dtype.
        capacity_bytes: pool size in bytes; ``capacity_bytes // spec.block_nbytes`` slots.
        device: torch device of the pool tensor.
        pin_memory: pin the (CPU) tensor for asynchronous host<->device copies.

    Raises:
        ValueError: capacity smaller than one block.
    """

    def __init__(
        self,
        medium: Medium,
        spec: KVSpec,
        capacity_bytes: int,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
    ) -> None:
        num_blocks = capacity_bytes // spec.block_nbytes
        if num_blocks < 1:
            raise ValueError(
                f"expected {medium} capacity >= one block ({spec.block_nbytes} bytes), got {capacity_bytes}"
            )
        self.medium = medium
        self.spec = spec
        self.num_blocks = num_blocks
        on_host = torch.device(device).type == "cpu"
        pad = FRAME_PAD_NBYTES if on_host else 0
        if on_host and not pin_memory:  # on huge pages (kvtier.tiers.host_memory: a hit's gather)
            flat = host_empty(pad + num_blocks * spec.block_nbytes)
        else:
            flat = torch.empty(
                pad + num_blocks * spec.block_nbytes, dtype=torch.uint8, device=device, pin_memory=pin_memory
            )
        self.tensor = flat[pad:].view(spec.dtype).view(num_blocks, *spec.block_shape)
        # Slot 0 is handed out first: pop() from the end of a reversed list.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._fingerprints: list[Fingerprint] = [NO_FINGERPRINT] * num_blocks  # per slot
        self._digests: list[int | None] = [None] * num_blocks  # per slot: its bytes' xxh3-64, if known
        # block_hash -> block_id, in eviction order (kvtier.tiers.lru).
        self._lru: SegmentedLRU[BlockHash, int] = SegmentedLRU(max_ghosts=2 * num_blocks)
        self._held: set[int] = set()  # slots out of the index, not free: see clear(hold=...)

    # -- queries ---------------------------------------------------------------------------
    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def index_segments(self) -> tuple[Mapping[BlockHash, int], Mapping[BlockHash, int]]:
        """The index's two segments (``block_hash -> block_id``): a block is here iff it is
        in either (:meth:`kvtier.tiers.lru.SegmentedLRU.segments`; read only)."""
        return self._lru.segments()

    def block_id(self, block_hash: BlockHash) -> int | None:
        return self._lru.get(block_hash)

    def fingerprint(self, block_hash: BlockHash) -> Fingerprint | None:
        """The token fingerprint kept with ``block_hash``'s slot, ``None`` if not here."""
        block_id = self._lru.get(block_hash)
        return None if block_id is None else self._fingerprints[block_id]

    def fingerprint_at(self, block_id: int) -> Fingerprint:
        """The token fingerprint kept with slot ``block_id``."""
        return self._fingerprints[block_id]

    def payload_digest_at(self, block_id: int) -> int | None:
        """The xxh3-64 of slot ``block_id``'s bytes (:func:`kvtier.records.payload_digest`)
        as recorded by :meth:`set_payload_digest` since the slot was last allocated, else
        ``None`` (unknown: hash the slot)."""
        return self._digests[block_id]

    def set_payload_digest(self, block_id: int, digest: int | None) -> None:
        """Record the xxh3-64 of the bytes just written into slot ``block_id`` (a slot the
        caller allocated and wrote, before it is published; ``None``: unknown). Forgotten
        when the slot is allocated again, freed or cleared. A digest of other bytes than the
        slot's makes the records made of it fail their checksum on read (``CORRUPT``)."""
        self._digests[block_id] = digest

    @property
    def device(self) -> torch.device:
        """Where the pool lives (``cuda:0``, ``cpu``): its medium is named after it."""
        return self.tensor.device

    @property
    def capacity_bytes(self) -> int:
        return self.num_blocks * self.spec.block_nbytes

    @property
    def used_bytes(self) -> int:
        return len(self._lru) * self.spec.block_nbytes

    @property
    def num_free(self) -> int:
        return len(self._free)

    def was_evicted(self, block_hash: BlockHash) -> bool:
        """Whether ``block_hash`` was evicted from this pool recently (its ghost list: the
        last ``2 * num_blocks`` victims) and not stored here again since."""
        return self._lru.was_evicted(block_hash)

    def lru_order(self) -> Iterator[BlockHash]:
        """Block hashes in eviction order (probation LRU first, then protected LRU); lazy:
        do not change the pool while iterating."""
        return self._lru.eviction_order()

    # -- mutations -------------------------------------------------------------------------
    def touch(self, block_hash: BlockHash) -> None:
        """A use of ``block_hash``: most recently used, protected from scans."""
        self._lru.touch(block_hash)

    def touch_many(self, block_hashes: Sequence[BlockHash]) -> None:
        """:meth:`touch` of each of ``block_hashes`` held here, in order (others skipped)."""
        self._lru.touch_many(block_hashes)

    def refresh(self, block_hash: BlockHash) -> None:
        """Most recent within its segment, without counting a use."""
        self._lru.refresh(block_hash)

    def allocate(self, block_hash: BlockHash, fingerprint: Fingerprint = NO_FINGERPRINT) -> int | None:
        """Reserve a free slot for ``block_hash`` (most recently used), kept with
        ``fingerprint`` (the tokens the bytes written there are computed from). ``None``
        when full."""
        assert block_hash not in self._lru, "block already in pool"
        assert len(fingerprint) == 32, "fingerprints are 32 bytes"
        if not self._free:
            return None
        block_id = self._free.pop()
        self._lru.add(block_hash, block_id)
        self._fingerprints[block_id] = fingerprint
        self._digests[block_id] = None
        return block_id

    def free(self, block_hash: BlockHash, evicted: bool = False) -> int:
        """Drop ``block_hash``'s copy; its slot becomes free. Returns the freed block_id.
        ``evicted``: dropped to make room (remembered for the eviction policy)."""
        block_id = self._lru.pop(block_hash, evicted=evicted)
        self._free.append(block_id)
        self._fingerprints[block_id] = NO_FINGERPRINT
        self._digests[block_id] = None
        return block_id

    def clear(self, hold: Sequence[BlockHash] = ()) -> dict[BlockHash, int]:
        """Empty the index (and the eviction policy's memory). The slots of the blocks in
        ``hold`` (someone still reads or writes them) leave the index but are not free:
        returns ``{block_hash: block_id}`` of those, each to be given back with
        :meth:`release_slot`."""
        held = {h: self._lru[h] for h in hold if h in self._lru}
        self._lru.clear()
        self._held.update(held.values())
        self._free = [i for i in range(self.num_blocks - 1, -1, -1) if i not in self._held]
        for i in self._free:
            self._fingerprints[i] = NO_FINGERPRINT
            self._digests[i] = None
        return held

    def release_slot(self, block_id: int) -> None:
        """Free a slot that :meth:`clear` held."""
        self._held.remove(block_id)
        self._fingerprints[block_id] = NO_FINGERPRINT
        self._digests[block_id] = None
        self._free.append(block_id)

    @property
    def num_held(self) -> int:
        """Slots held out of the index by :meth:`clear`, not yet released."""
        return len(self._held)

    def check(self) -> None:
        """Invariant check for tests: every slot is free, owned by one hash or held."""
        owned = list(self._lru.values())
        assert len(set(owned)) == len(owned), "two hashes share one slot"
        assert not set(owned) & set(self._free), "a slot is both owned and free"
        assert not self._held & (set(owned) | set(self._free)), "a held slot is owned or free"
        assert len(owned) + len(self._free) + len(self._held) == self.num_blocks, "a slot leaked"
