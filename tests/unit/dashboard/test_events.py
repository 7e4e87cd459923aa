"""KV events (vLLM's schema): the library's publisher keeps a subscriber's view equal to what
the store holds; the SSE endpoint streams it with a snapshot first and resumes from a cursor;
the daemon serves the stream and explanations over its namespaces."""

from __future__ import annotations

import json
import random
import urllib.request

import msgpack
import pytest
import torch
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvtier.config import StoreConfig
from kvtier.dashboard import setup_events
from kvtier.server.app import make_app
from kvtier.store import TieredStore
from kvtier.store.events import (
    AllBlocksCleared, BlockRemoved, BlockStored, batch_to_dict, event_from_dict, event_to_dict,
)
from kvtier.tiers.disk import record_footprint
from kvtier.types import KVSpec
from kvtier.wire import pack
from tests.conftest import random_blocks
from tests.unit.server.conftest import NAMESPACE, SPEC as DAEMON_SPEC, frames, hashes, ns_url, register, serve_settings

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=4, block_size=16, dtype=torch.float32)


def make_store(tmp_path, gpu: int = 4, cpu: int = 6, disk: int = 12) -> TieredStore:
    config = StoreConfig(gpu_bytes=gpu * SPEC.block_nbytes, cpu_bytes=cpu * SPEC.block_nbytes,
                         disk_bytes=disk * record_footprint(SPEC.block_nbytes), block_size=16,
                         data_dir=tmp_path / "s", flush_on_close=False)
    return TieredStore(SPEC, config, bytes(32), device="cpu", emulate_gpu=True)


def chain(n: int, salt: int) -> list[bytes]:
    return hashes(n, salt, size=16)


def apply(view: dict[str, set], batch) -> None:
    for event in batch.events:
        if isinstance(event, AllBlocksCleared):
            view.clear()
        elif isinstance(event, BlockStored):
            view.setdefault(event.medium, set()).update(event.block_hashes)
        else:
            view.setdefault(event.medium, set()).difference_update(event.block_hashes)


def held(store: TieredStore) -> dict[str, set]:
    return {str(m): set(hs) for m, hs in store.placement.held_blocks().items()}


def traffic(store: TieredStore, rng: random.Random, requests: int) -> None:
    """Chats that grow, loads from every tier, spills and evictions."""
    chats = [chain(12, salt) for salt in range(6)]
    for _ in range(requests):
        blocks = chats[rng.randrange(len(chats))][: rng.randrange(1, 12)]
        store.load(blocks).lease.release()
        store.store(blocks, random_blocks(SPEC, len(blocks)))


def test_a_subscribers_view_is_what_the_store_holds(tmp_path):
    store = make_store(tmp_path)
    queue = store.events.queue()
    traffic(store, random.Random(0), 200)
    view: dict[str, set] = {}
    batches = queue.drain()
    assert [b.seq for b in batches] == list(range(1, len(batches) + 1)) and queue.lost == 0
    for batch in batches:
        apply(view, batch)
    assert {k: v for k, v in view.items() if v} == {k: v for k, v in held(store).items() if v}
    kinds = {type(e).__name__ + "/" + str(getattr(e, "medium", "")) for b in batches for e in b.events}
    assert {"BlockStored/GPU", "BlockRemoved/GPU", "BlockStored/CPU", "BlockRemoved/CPU", "BlockStored/DISK"} <= kinds
    store.close()


def test_stored_events_carry_the_vllm_fields_and_the_chains_parent(tmp_path):
    store = make_store(tmp_path)
    queue = store.events.queue()
    hs = chain(3, salt=9)
    store.store(hs[:1], random_blocks(SPEC, 1))
    store.store(hs, random_blocks(SPEC, 3))
    first, second, third = queue.drain()  # the second store goes in chunks of half the top pool
    assert first.events == [BlockStored([hs[0]], None, [], 16, None, "GPU", None)]
    assert second.events == [BlockStored(hs[1:2], hs[0], [], 16, None, "GPU", None)]
    assert third.events == [BlockStored(hs[2:], hs[1], [], 16, None, "GPU", None)]
    doc = event_to_dict(second.events[0])
    assert set(doc) == {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                        "lora_name"}
    assert event_from_dict(doc) == second.events[0]
    assert event_from_dict(event_to_dict(BlockRemoved([hs[0]], "CPU"))) == BlockRemoved([hs[0]], "CPU")
    with pytest.raises(ValueError):
        event_from_dict({"type": "BlockStored", "block_hashes": ["zz"]})
    store.close()


def test_no_subscriber_no_events_built(tmp_path):
    store = make_store(tmp_path)
    assert not store.events.active
    traffic(store, random.Random(1), 20)
    assert store.events.seq == 0
    store.close()


def sse_batches(url: str, count: int, timeout: float = 10.0) -> list[dict]:
    """The first ``count`` batches of an SSE stream (then the connection is closed)."""
    out: list[dict] = []
    with urllib.request.urlopen(url, timeout=timeout) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        event_id = None
        for raw in response:
            line = raw.decode().rstrip("\n")
            if line.startswith("id: "):
                event_id = int(line[4:])
            elif line.startswith("data: "):
                doc = json.loads(line[6:])
                assert doc["seq"] == event_id
                out.append(doc)
                if len(out) == count:
                    return out
    return out


def test_sse_stream_starts_with_a_snapshot_and_resumes_from_a_cursor(tmp_path, live_server):
    store = make_store(tmp_path)
    traffic(store, random.Random(2), 30)  # before anyone listens: the snapshot has it

    def app() -> web.Application:
        application = web.Application()
        setup_events(application, lambda request: {"chat": store})
        return application

    server = live_server(app)
    (snapshot,) = sse_batches(f"{server.url}/v1/events?namespace=chat", 1)
    assert snapshot["namespace"] == "chat" and snapshot["events"][0] == {"type": "AllBlocksCleared"}
    view = {e["medium"]: set(e["block_hashes"]) for e in snapshot["events"][1:]}
    assert view == {m: {h.hex() for h in hs} for m, hs in held(store).items() if hs}
    cursor = snapshot["seq"]
    hs = chain(2, salt=77)
    store.store(hs, random_blocks(SPEC, 2))  # published after the client left (with the spills it caused)
    missed = store.events.seq - cursor
    resumed = sse_batches(f"{server.url}/v1/events?cursor={cursor}", missed)  # one store: no namespace needed
    assert [b["seq"] for b in resumed] == list(range(cursor + 1, cursor + missed + 1))
    assert all(e["type"] != "AllBlocksCleared" for b in resumed for e in b["events"])
    stored = {h for b in resumed for e in b["events"] if e["type"] == "BlockStored" and e["medium"] == "GPU"
              for h in e["block_hashes"]}
    assert {h.hex() for h in hs} <= stored
    (again,) = sse_batches(f"{server.url}/v1/events?cursor={10**9}", 1)  # another server's cursor
    assert again["events"][0] == {"type": "AllBlocksCleared"}
    for bad in ("cursor=-1", "cursor=x", "namespace=nope"):
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"{server.url}/v1/events?{bad}", timeout=5)
        assert info.value.code in (400, 404)
    store.close()


def test_batch_json_is_the_streams_data(tmp_path):
    store = make_store(tmp_path)
    queue = store.events.queue()
    store.store(chain(1, 5), random_blocks(SPEC, 1))
    (batch,) = queue.drain()
    doc = batch_to_dict(batch)
    assert doc["seq"] == 1 and doc["events"][0]["type"] == "BlockStored" and doc["data_parallel_rank"] is None
    store.close()


@pytest.fixture
async def daemon(tmp_path):
    client = TestClient(TestServer(make_app(serve_settings(tmp_path / "data"))))
    await client.start_server()
    yield client
    await client.close()


async def test_daemon_streams_events_and_explains(daemon):
    await register(daemon)
    hs = hashes(6)
    response = await daemon.post(ns_url(op="put"), data=frames(NAMESPACE, hs[:4], random_blocks(DAEMON_SPEC, 4)))
    assert response.status == 200
    response = await daemon.get(f"/v1/events?namespace={NAMESPACE.hex()}")
    assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
    line = b""
    while not line.startswith(b"data: "):
        line = await response.content.readline()
    snapshot = json.loads(line[6:])
    assert snapshot["events"][0]["type"] == "AllBlocksCleared"
    assert {h for e in snapshot["events"][1:] for h in e["block_hashes"]} == {h.hex() for h in hs[:4]}
    response.close()
    body = msgpack.packb({"block_hashes": hs, "num_tokens": 6 * DAEMON_SPEC.block_size + 3}, use_bin_type=True)
    response = await daemon.post(ns_url(op="explain"), data=body, headers={"Content-Type": "application/msgpack"})
    assert response.status == 200, await response.text()
    doc = await response.json()
    assert [b["reason"] for b in doc["blocks"]] == [None] * 4 + ["never_stored"] * 2
    assert doc["tail_tokens"] == 3 and doc["hit_tokens"] == 4 * DAEMON_SPEC.block_size
    stats = await (await daemon.get("/v1/stats")).json()
    assert stats["total"]["lookup_tokens"] == 0  # an explanation counts nothing
    response = await daemon.post(ns_url(op="explain"), data=pack({"block_hashes": ["x"]}),
                                 headers={"Content-Type": "application/msgpack"})
    assert response.status == 400
    response = await daemon.post(ns_url(bytes(32), op="explain"), data=pack({"block_hashes": hs}),
                                 headers={"Content-Type": "application/msgpack"})
    assert response.status == 404
