"""The put path's direct receive (kvtier.server.frames._Direct): each frame's payload read
from the socket straight into a reserved top-pool slot, published only once its checksum
holds, for a store with nothing below its pool (``disk_blocks=0``); the staging path where a
frame gets no fresh slot, and for every frame of a store with a DISK tier (its spills go in
batches) or a durable daemon."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import torch
import xxhash

from kvtier.records import HEADER_NBYTES, ReadStatus
from kvtier.server import frames as frames_module
from kvtier.server.app import REGISTRY
from kvtier.types import Medium
from kvtier.wire import FRAMES
from tests.conftest import random_blocks
from tests.unit.server.conftest import NAMESPACE, SPEC, frames, hashes, ns_url, register
from tests.unit.server.test_api import get_blocks, lookup, payload, put_blocks

pytestmark = pytest.mark.usefixtures("put_reads")  # each test with aiohttp's reads and the receiver's

FRAME_NBYTES = 1 + 32 + HEADER_NBYTES + SPEC.block_nbytes
DIRECT = {"disk_blocks": 0}
MODES = {"direct": DIRECT, "staging (DISK below)": {}}


def _store(client):
    return client.server.app[REGISTRY].get("default", NAMESPACE).store


def _no_staging(monkeypatch):
    """Fail the put if any frame takes the staging path."""
    async def refuse(*args, **kwargs):
        raise AssertionError("a frame took the staging path")

    monkeypatch.setattr(frames_module._Batch, "start", refuse)


def _count_staged(monkeypatch) -> list[int]:
    """Frames stored through the staging path (each ``_store`` call adds its block count)."""
    counts: list[int] = []
    store = frames_module._store

    def counting(s, block_hashes, blocks, fingerprints, durable):
        counts.append(len(block_hashes))
        return store(s, block_hashes, blocks, fingerprints, durable)

    monkeypatch.setattr(frames_module, "_store", counting)
    return counts


def _pending(store) -> int:
    return len(store.residency.pending(Medium.CPU))


def _free_slots_in_use(store) -> int:
    return store.top.num_blocks - store.top.num_free


class RawPut:
    """A put sent by hand over one socket (a body sent in parts, a client that goes away)."""

    def __init__(self, client, body_nbytes: int) -> None:
        self.client, self.body_nbytes = client, body_nbytes

    async def __aenter__(self) -> "RawPut":
        server = self.client.server
        self.reader, self.writer = await asyncio.open_connection(server.host, server.port)
        head = (f"POST {ns_url(NAMESPACE, 'put')} HTTP/1.1\r\nHost: {server.host}:{server.port}\r\n"
                f"Content-Type: {FRAMES}\r\nConnection: close\r\nContent-Length: {self.body_nbytes}\r\n\r\n")
        self.writer.write(head.encode())
        await self.writer.drain()
        return self

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def reply(self) -> list[bool]:
        raw = await asyncio.wait_for(self.reader.read(), 10)
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), raw[:300]
        return msgpack.unpackb(body)["stored"]

    async def __aexit__(self, *exc) -> None:
        self.writer.close()


async def _until(predicate, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


async def test_direct_put_is_bit_exact_without_staging(make_api, monkeypatch):
    client = await make_api(**DIRECT)
    await register(client)
    _no_staging(monkeypatch)
    hs, blocks = hashes(12), random_blocks(SPEC, 12, seed=11)
    assert await put_blocks(client, hs, blocks) == [True] * 12
    assert await lookup(client, hs) == {"num_blocks": 12, "media": ["CPU"] * 12}
    got = await get_blocks(client, hs)
    assert [p for _, _, p in got] == [payload(b) for b in blocks]
    store = _store(client)
    assert _pending(store) == 0 and store.ref_cnt(hs[0]) == 0
    store.check_invariants()


@pytest.mark.parametrize("path", ["direct", "staging"])
async def test_both_paths_store_the_same_bytes_and_flag_the_same_corrupt_frame(make_api, monkeypatch, path):
    client = await make_api(disk_blocks=0)
    await register(client)
    if path == "staging":  # as for a top pool in GPU memory
        monkeypatch.setattr(frames_module._Direct, "of", classmethod(lambda cls, registry, entry: None))
    else:
        _no_staging(monkeypatch)
    hs, blocks = hashes(5), random_blocks(SPEC, 5, seed=12)
    body = bytearray(frames(NAMESPACE, hs, blocks))
    body[2 * FRAME_NBYTES + 1 + 32 + HEADER_NBYTES + 100] ^= 0x01  # one payload bit of frame 2
    before = _free_slots_in_use(_store(client))
    response = await client.post(ns_url(NAMESPACE, "put"), data=bytes(body))
    assert msgpack.unpackb(await response.read())["stored"] == [True, True, False, True, True]
    store = _store(client)
    assert _free_slots_in_use(store) == before + 4  # the corrupt frame's slot was freed
    assert (await lookup(client, hs))["num_blocks"] == 2
    assert await get_blocks(client, [hs[2]]) == []
    assert [p for _, _, p in await get_blocks(client, hs[3:])] == [payload(b) for b in blocks[3:]]
    assert client.server.app[REGISTRY].get("default", NAMESPACE).rejected_blocks == 1
    store.check_invariants()


async def test_a_lookup_during_the_put_never_sees_the_block_being_received(make_api):
    client = await make_api(**DIRECT)
    await register(client)
    hs, blocks = hashes(3), random_blocks(SPEC, 3, seed=13)
    body = frames(NAMESPACE, hs, blocks)
    async with RawPut(client, len(body)) as put:
        await put.send(body[: FRAME_NBYTES + 40 + HEADER_NBYTES + 200])  # frame 0, then part of frame 1
        store = _store(client)
        await _until(lambda: store.top.block_id(hs[0]) is not None and _pending(store) == 1)
        assert await lookup(client, hs) == {"num_blocks": 1, "media": ["CPU"]}
        assert await get_blocks(client, hs[1:2]) == []
        await put.send(body[FRAME_NBYTES + 40 + HEADER_NBYTES + 200 :])
        assert await put.reply() == [True] * 3
    assert [p for _, _, p in await get_blocks(client, hs)] == [payload(b) for b in blocks]
    store.check_invariants()


@pytest.mark.parametrize("cut", ["in the payload", "in the header"])
async def test_a_client_gone_mid_frame_frees_its_slot_and_publishes_no_part_of_it(make_api, cut):
    client = await make_api(**DIRECT)
    await register(client)
    hs, blocks = hashes(3), random_blocks(SPEC, 3, seed=14)
    body = frames(NAMESPACE, hs, blocks)
    end = FRAME_NBYTES + 1 + 32 + HEADER_NBYTES + (300 if cut == "in the payload" else -60)
    store = _store(client)
    before = _free_slots_in_use(store)
    async with RawPut(client, len(body)) as put:
        await put.send(body[:end])
        # (aiohttp drops what it buffered of a body once its connection is lost: close only
        # once frame 0 is stored and frame 1 is where the cut says)
        await _until(lambda: store.top.block_id(hs[0]) is not None)
        if cut == "in the payload":
            await _until(lambda: _pending(store) == 1)
    # the socket is closed: the daemon's read fails, the slot of frame 1 is freed
    await _until(lambda: _pending(store) == 0 and _free_slots_in_use(store) == before + 1)
    assert await lookup(client, hs) == {"num_blocks": 1, "media": ["CPU"]}
    assert await get_blocks(client, hs[1:2]) == []
    assert [p for _, _, p in await get_blocks(client, hs[:1])] == [payload(blocks[0])]
    assert store.ref_cnt(hs[0]) == 0
    store.check_invariants()
    assert await put_blocks(client, hs, blocks) == [True] * 3  # the same blocks go in again


async def test_a_truncated_body_is_a_400_and_leaves_no_slot(make_api):
    client = await make_api(disk_blocks=0)
    await register(client)
    hs, blocks = hashes(2), random_blocks(SPEC, 2, seed=15)
    body = frames(NAMESPACE, hs, blocks)[: FRAME_NBYTES + 1 + 32 + HEADER_NBYTES + 100]
    response = await client.post(ns_url(NAMESPACE, "put"), data=body)
    assert response.status == 400 and "ends inside a block" in await response.text()
    store = _store(client)
    assert _pending(store) == 0 and _free_slots_in_use(store) == 1
    assert (await lookup(client, hs))["num_blocks"] == 1
    store.check_invariants()


async def test_a_block_another_request_is_writing_goes_through_staging(make_api, monkeypatch):
    """Concurrent puts of the same hash: the second finds the slot pending and takes the
    staging path, which refuses it as ``TieredStore.store`` does; nothing is corrupted."""
    client = await make_api(**DIRECT)
    await register(client)
    staged = _count_staged(monkeypatch)
    hs, blocks = hashes(3), random_blocks(SPEC, 3, seed=16)
    store = _store(client)
    other = store.prepare_store([hs[1]])  # another request is writing hs[1]
    assert other.block_ids
    assert await put_blocks(client, hs, blocks) == [True, False, True]
    assert staged == [1]
    assert (await lookup(client, hs))["num_blocks"] == 1
    store.complete_store(other, success=False)
    assert await put_blocks(client, hs, blocks) == [True] * 3  # hs[0], hs[2] stored: staged, hs[1]: direct
    assert [p for _, _, p in await get_blocks(client, hs)] == [payload(b) for b in blocks]
    store.check_invariants()


@pytest.mark.parametrize("mode", MODES)
async def test_concurrent_puts_of_the_same_blocks_store_one_intact_copy(make_api, mode):
    client = await make_api(**MODES[mode])
    await register(client)
    hs, blocks = hashes(8), random_blocks(SPEC, 8, seed=17)
    body = frames(NAMESPACE, hs, blocks)
    half = len(body) // 2 + 17
    async with RawPut(client, len(body)) as a, RawPut(client, len(body)) as b:
        await a.send(body[:half])
        await b.send(body[:half])
        await a.send(body[half:])
        await b.send(body[half:])
        stored_a, stored_b = await a.reply(), await b.reply()
    assert all(x or y for x, y in zip(stored_a, stored_b))
    assert [p for _, _, p in await get_blocks(client, hs)] == [payload(b) for b in blocks]
    store = _store(client)
    assert _pending(store) == 0
    store.check_invariants()


async def test_a_pool_with_every_slot_pinned_falls_back_and_refuses(make_api, monkeypatch):
    client = await make_api(cpu_blocks=2, disk_blocks=0)
    await register(client)
    staged = _count_staged(monkeypatch)
    old, new = hashes(2, salt=1), hashes(2, salt=2)
    blocks = random_blocks(SPEC, 4, seed=18)
    assert await put_blocks(client, old, blocks[:2]) == [True, True]
    store = _store(client)
    pinned = store.lookup(old, pin=True)  # a get in flight holds both slots
    assert await put_blocks(client, new, blocks[2:]) == [False, False]
    assert sum(staged) == 2  # no fresh slot: both frames went to staging, which found none either
    pinned.lease.release()
    assert await put_blocks(client, new, blocks[2:]) == [True, True]
    assert sum(staged) == 2  # then straight into slots
    assert (await lookup(client, new))["num_blocks"] == 2
    for h, block in zip(new, blocks[2:]):  # one at a time: a get pins a quarter of this pool at most
        assert [p for _, _, p in await get_blocks(client, [h])] == [payload(block)]
    store.check_invariants()


@pytest.mark.parametrize("path", ["direct", "staging"])
async def test_a_batch_longer_than_the_pool_stores_its_head_and_is_refused_the_rest(make_api, monkeypatch, path):
    """Case B2 (never claim more than is stored): a put's own blocks are protected until it
    ends, so its tail never evicts its head, and both paths answer alike (the direct path
    once evicted its own head and acknowledged all ten, so that a lookup found none)."""
    if path == "staging":
        monkeypatch.setattr(frames_module._Direct, "of", classmethod(lambda cls, registry, entry: None))
    client = await make_api(cpu_blocks=4, disk_blocks=0)
    await register(client)
    staged = _count_staged(monkeypatch)
    hs, blocks = hashes(10), random_blocks(SPEC, 10, seed=19)
    assert await put_blocks(client, hs, blocks) == [True] * 4 + [False] * 6
    assert (await lookup(client, hs))["num_blocks"] == 4
    if path == "direct":
        assert sum(staged) == 6  # the head straight into slots; the tail found none on either path
    for h, block in zip(hs[:4], blocks[:4]):
        assert [p for _, _, p in await get_blocks(client, [h])] == [payload(block)]
    store = _store(client)
    assert not any(store.residency.is_protected(h) for h in hs)  # released when the put ended
    for _ in range(100):  # the gets' leases are released once their replies are sent
        if all(store.residency.evictable(Medium.CPU, h) for h in hs[:4]):
            break
        await asyncio.sleep(0.02)
    others, more = hashes(4, salt=7), random_blocks(SPEC, 4, seed=20)
    assert await put_blocks(client, others, more) == [True] * 4  # the next put may evict them
    assert (await lookup(client, others))["num_blocks"] == 4
    store.check_invariants()


@pytest.mark.parametrize("path", ["direct", "staging"])
async def test_a_put_beside_a_pinned_block_keeps_its_head(make_api, monkeypatch, path):
    if path == "staging":
        monkeypatch.setattr(frames_module._Direct, "of", classmethod(lambda cls, registry, entry: None))
    client = await make_api(cpu_blocks=4, disk_blocks=0)
    await register(client)
    other, hs = hashes(1, salt=3), hashes(4, salt=4)
    blocks = random_blocks(SPEC, 5, seed=22)
    assert await put_blocks(client, other, blocks[:1]) == [True]
    store = _store(client)
    pinned = store.lookup(other, pin=True)  # a get in flight holds one slot
    assert await put_blocks(client, hs, blocks[1:]) == [True, True, True, False]
    assert (await lookup(client, hs))["num_blocks"] == 3
    pinned.lease.release()
    store.check_invariants()


@pytest.mark.parametrize("setting", [{}, {"durable": True}])
async def test_a_store_with_disk_and_a_durable_daemon_take_the_staging_path(make_api, monkeypatch, setting):
    client = await make_api(**setting)
    await register(client)
    staged = _count_staged(monkeypatch)
    hs, blocks = hashes(5), random_blocks(SPEC, 5, seed=20)
    assert await put_blocks(client, hs, blocks) == [True] * 5
    assert sum(staged) == 5
    store = _store(client)
    assert all(h in store.disk for h in hs) or not setting
    assert [p for _, _, p in await get_blocks(client, hs)] == [payload(b) for b in blocks]
    store.check_invariants()


def _hold_lock(store):
    """A thread holding ``store``'s lock until the returned event is set: (thread, event)."""
    import threading

    held, go = threading.Event(), threading.Event()

    def hold():
        with store.residency.lock:
            held.set()
            go.wait(5)

    thread = threading.Thread(target=hold)
    thread.start()
    assert held.wait(5)
    return thread, go


async def test_a_put_that_finds_the_store_lock_held_waits_for_it_on_a_thread(make_api, monkeypatch):
    client = await make_api(**DIRECT)
    await register(client)
    _no_staging(monkeypatch)
    store = _store(client)
    thread, go = _hold_lock(store)
    hs, blocks = hashes(3), random_blocks(SPEC, 3, seed=21)
    put = asyncio.ensure_future(put_blocks(client, hs, blocks))
    await asyncio.sleep(0.3)
    assert not put.done()  # its prepare_store waits on a registry thread, the loop serves on
    go.set()
    assert await put == [True] * 3
    thread.join()
    assert [p for _, _, p in await get_blocks(client, hs)] == [payload(b) for b in blocks]
    store.check_invariants()


def test_prepare_store_without_waiting_gives_way_to_a_lock_holder(tmp_path):
    from kvtier.config import StoreConfig
    from kvtier.store import TieredStore

    store = TieredStore(SPEC, StoreConfig(gpu_bytes=0, cpu_bytes=4 * SPEC.block_nbytes, disk_bytes=0,
                                          data_dir=tmp_path, block_size=SPEC.block_size), namespace=NAMESPACE)
    h = hashes(1)
    thread, go = _hold_lock(store)
    assert store.prepare_store(h, blocking=False) is None
    go.set()
    thread.join()
    handle = store.prepare_store(h, blocking=False)
    assert handle is not None and handle.block_ids
    store.top.tensor[handle.block_ids[0]] = 1.0
    assert store.lookup(h).num_hit_blocks == 0  # pending: invisible
    store.complete_store(handle)
    assert store.lookup(h).num_hit_blocks == 1
    assert torch.equal(store.top.tensor[store.top.block_id(h[0])], torch.ones(SPEC.block_shape))
    store.check_invariants()
    store.close()


@pytest.mark.parametrize("mode", MODES)
async def test_a_put_keeps_each_slots_digest_and_a_get_hashes_no_block(make_api, monkeypatch, mode):
    """The payload's digest, computed as the frame lands (direct) or as the staged block is
    copied into its slot (staging: ``TieredStore.store``'s fused copy), is kept beside the
    slot; a get then makes each record's header from it, and the client verifies the records."""
    from kvtier import records
    from kvtier.kernels import host_copy
    from kvtier.records import decode_into

    if mode != "direct" and not host_copy.hashing_available():
        pytest.skip("no compiled host kernels with python-xxhash's xxh3: the staged copy hashes nothing")
    client = await make_api(**MODES[mode])
    await register(client)
    hs, blocks = hashes(6), random_blocks(SPEC, 6, seed=21)
    assert await put_blocks(client, hs, blocks) == [True] * 6
    top = _store(client).top
    for h in hs:
        b = top.block_id(h)
        assert top.payload_digest_at(b) == xxhash.xxh3_64_intdigest(payload(top.tensor[b]))
    hashed = []
    real = records.payload_digest
    monkeypatch.setattr(records, "payload_digest", lambda block: hashed.append(1) or real(block))
    got = await get_blocks(client, hs)
    assert hashed == []
    out = torch.empty(SPEC.block_shape, dtype=SPEC.dtype)
    for (h, header, body), block in zip(got, blocks):
        assert decode_into(memoryview(header + body), NAMESPACE, out) is ReadStatus.OK and torch.equal(out, block)
