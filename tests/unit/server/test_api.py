"""The daemon's HTTP API through aiohttp's test client: round trips, prefix lookups,
registration rules, restarts, limits (case S1), bad input of every kind, auth."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import msgpack
import pytest
import torch
from click.testing import CliRunner

from kvtier.app.cli import main
from kvtier.records import HEADER_NBYTES, encode_header
from kvtier.server.app import REGISTRY, SETTINGS
from kvtier.server.layout import MARKER_FILE, SPEC_FILE
from kvtier.server.settings import ServeConfig
from kvtier.wire import END, frame_prefix, pack, pack_spec, spec_from_wire, spec_to_wire, unpack_spec
from kvtier.types import KVSpec, LayerGroup, Medium
from tests.conftest import random_blocks
from tests.unit.server.conftest import (
    NAMESPACE,
    SPEC,
    frames,
    hashes,
    ns_dir,
    ns_url,
    parse_frames,
    register,
    serve_settings,
)


async def put_blocks(client, block_hashes, blocks, namespace=NAMESPACE) -> list[bool]:
    response = await client.post(ns_url(namespace, "put"), data=frames(namespace, block_hashes, blocks))
    assert response.status == 200, await response.text()
    return msgpack.unpackb(await response.read())["stored"]


async def lookup(client, block_hashes, namespace=NAMESPACE) -> dict:
    response = await client.post(ns_url(namespace, "lookup"), data=pack({"block_hashes": block_hashes}))
    assert response.status == 200, await response.text()
    return msgpack.unpackb(await response.read())


async def get_blocks(client, block_hashes, namespace=NAMESPACE) -> list[tuple[bytes, bytes, bytes]]:
    response = await client.post(ns_url(namespace, "get"), data=pack({"block_hashes": block_hashes}))
    assert response.status == 200, await response.text()
    return parse_frames(await response.read())


def payload(block: torch.Tensor) -> bytes:
    return block.contiguous().view(torch.uint8).numpy().tobytes()


MLA_SPEC = KVSpec.from_groups([LayerGroup("mla", (0, 1), 1, 32, 8)], 4, torch.float32)  # flat: [320]
HYBRID_SPEC = KVSpec.from_groups(
    [LayerGroup("sliding", (0,), 1, 8, 8, window=6), LayerGroup("full", (1,), 1, 8, 8)], 4, torch.float32
)  # [2, 2, 4, 1, 8], like SPEC


def _grouped(groups=None, block_size=4, block_shape=None, extra=None, **fields) -> bytes:
    """A register body for a one-group sliding spec of 2 layers, with ``fields`` replaced."""
    group = {"kind": "sliding", "layers": [0, 1], "num_kv_heads": 1, "k_head_dim": 8, "v_head_dim": 8, "window": 6}
    group.update(fields)
    if extra is not None:
        group["extra"] = extra
    body = {"block_shape": block_shape or [2, 2, 4, 1, 8], "dtype": "float32",
            "groups": [group] if groups is None else groups}
    if block_size is not None:
        body["block_size"] = block_size
    return pack(body)


async def test_put_then_get_is_bit_exact_and_lookup_gives_the_prefix(make_api):
    client = await make_api()
    await register(client)
    hs, blocks = hashes(6), random_blocks(SPEC, 6, seed=1)
    assert await put_blocks(client, hs[:4], blocks[:4]) == [True] * 4

    found = await lookup(client, hs)
    assert found == {"num_blocks": 4, "media": ["CPU"] * 4}
    assert (await lookup(client, [hs[5]] + hs[:4]))["num_blocks"] == 0  # a prefix, not a count

    got = await get_blocks(client, hs)  # leading present blocks only
    assert [h for h, _, _ in got] == hs[:4]
    for (_, header, body), block, h in zip(got, blocks, hs):
        assert body == payload(block)
        assert header == encode_header(NAMESPACE, block)
    assert await get_blocks(client, [hs[4], hs[0]]) == []


async def test_put_is_idempotent_and_keeps_the_first_copy(make_api):
    client = await make_api()
    await register(client)
    hs, blocks = hashes(2), random_blocks(SPEC, 2, seed=2)
    assert await put_blocks(client, hs, blocks) == [True, True]
    assert await put_blocks(client, hs + [hs[0]], torch.cat([blocks, blocks[:1]])) == [True] * 3
    assert [p for _, _, p in await get_blocks(client, hs)] == [payload(b) for b in blocks]


async def test_register_is_idempotent_and_refuses_another_spec(make_api):
    client = await make_api(max_namespaces=2)
    first = await client.put(ns_url(), data=pack(spec_to_wire(SPEC)))
    again = await client.put(ns_url(), data=pack(spec_to_wire(SPEC)))
    assert (first.status, again.status) == (201, 200)
    reply = msgpack.unpackb(await again.read())
    assert reply["block_shape"] == list(SPEC.block_shape) and reply["created"] is False

    other = KVSpec(num_layers=3, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.float32)
    conflict = await client.put(ns_url(), data=pack(spec_to_wire(other)))
    assert conflict.status == 409 and "another" in (await conflict.json())["error"]

    await register(client, bytes(32), other)
    full = await client.put(ns_url(b"\x01" * 32), data=pack(spec_to_wire(SPEC)))
    assert full.status == 507 and "max-namespaces" in (await full.json())["error"]


@pytest.mark.parametrize("spec", [MLA_SPEC, HYBRID_SPEC], ids=["flat", "uniform"])
async def test_register_carries_layer_groups_and_they_survive_a_restart(make_api, tmp_path, spec):
    """A spec with layer groups registers with its groups (a flat MLA block is [block_numel]);
    the same block shape with other groups is another spec (409); blocks of a flat layout
    round-trip bit-exact and hit from DISK after the daemon restarts."""
    settings = serve_settings(tmp_path / "data", spec=spec)
    client = await make_api(settings)
    await register(client, spec=spec)
    info = msgpack.unpackb(await (await client.get(ns_url())).read())
    assert info["block_shape"] == list(spec.block_shape) and info["block_size"] == 4
    assert [g["kind"] for g in info["groups"]] == [g.kind for g in spec.groups]
    plain = KVSpec(2, 1, 8, 4, torch.float32)
    if plain.block_shape == spec.block_shape:  # same bytes per block, other layout: not the same spec
        conflict = await client.put(ns_url(), data=pack(spec_to_wire(plain)))
        assert conflict.status == 409 and "sliding(6)" in (await conflict.json())["error"]
    hs, blocks = hashes(3), random_blocks(spec, 3, seed=4)
    await put_blocks(client, hs, blocks)
    await client.close()

    client = await make_api(settings)
    assert client.server.app[REGISTRY].get("default", NAMESPACE).spec == spec
    assert (await lookup(client, hs)) == {"num_blocks": 3, "media": ["DISK"] * 3}
    assert [p for _, _, p in await get_blocks(client, hs)] == [payload(b) for b in blocks]


def test_a_full_attention_spec_is_encoded_as_before():
    assert spec_to_wire(SPEC) == {"block_shape": [2, 2, 4, 1, 8], "dtype": "float32"}
    assert spec_from_wire(spec_to_wire(MLA_SPEC)) == MLA_SPEC and unpack_spec(pack_spec(HYBRID_SPEC)) == HYBRID_SPEC


async def test_delete_drops_the_namespace_and_its_blocks(make_api, tmp_path):
    client = await make_api()
    await register(client)
    hs = hashes(3)
    await put_blocks(client, hs, random_blocks(SPEC, 3))
    assert (await client.delete(ns_url())).status == 200
    assert (await client.post(ns_url(NAMESPACE, "lookup"), data=pack({"block_hashes": hs}))).status == 404
    assert not ns_dir(tmp_path / "data").exists()
    assert (await client.delete(ns_url())).status == 404
    await register(client)  # registers afresh, empty
    assert (await lookup(client, hs))["num_blocks"] == 0


@pytest.mark.parametrize("name", ["%20" * 64, "00" * 31 + "%20%20", "%09" + "0" * 63, "0" * 63 + "%0A",
                                  NAMESPACE.hex().upper()])
async def test_a_namespace_that_is_not_64_lowercase_hex_digits_touches_no_directory(make_api, tmp_path, name):
    """Issue 12: 64 characters that ``bytes.fromhex`` decodes to fewer than 32 bytes (it skips
    whitespace) once named the data directory itself, and the failed registration's cleanup
    deleted every namespace. Every such name is a 400 now, for every verb, and nothing moves."""
    client = await make_api()
    await register(client)
    hs, blocks = hashes(3), random_blocks(SPEC, 3, seed=11)
    await put_blocks(client, hs, blocks)
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "data").rglob("*"))

    url = f"/v1/namespaces/{name}"
    for method, path, body in (("PUT", url, pack(spec_to_wire(SPEC))), ("GET", url, b""), ("DELETE", url, b""),
                               ("POST", url + "/put", frames(NAMESPACE, hs, blocks))):
        response = await client.request(method, path, data=body)
        assert response.status == 400, (method, await response.text())
        assert "64 lowercase hex digits" in (await response.json())["error"]

    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "data").rglob("*")) == before
    assert not (tmp_path / "data" / SPEC_FILE).exists()
    assert [p for _, _, p in await get_blocks(client, hs)] == [payload(b) for b in blocks]


async def test_restart_ignores_directories_not_named_by_a_namespace(make_api, tmp_path):
    settings = serve_settings(tmp_path / "data")
    client = await make_api(settings)
    await register(client)
    await client.close()
    stray = ns_dir(tmp_path / "data").parent / NAMESPACE.hex().upper()  # same bytes, another spelling
    stray.mkdir()
    for name in (SPEC_FILE, MARKER_FILE):
        (stray / name).write_bytes((ns_dir(tmp_path / "data") / name).read_bytes())

    client = await make_api(settings)
    registry = client.server.app[REGISTRY]
    assert [entry.path.name for entry in registry] == [NAMESPACE.hex()]
    assert stray.is_dir()  # left alone, never opened, never deleted


async def test_restart_reopens_namespaces_and_disk_blocks_hit(make_api, tmp_path):
    settings = serve_settings(tmp_path / "data")
    client = await make_api(settings)
    await register(client)
    hs, blocks = hashes(5), random_blocks(SPEC, 5, seed=3)
    await put_blocks(client, hs, blocks)
    await client.close()  # app cleanup closes the stores: memory tiers flushed to DISK

    client = await make_api(settings)
    assert (await lookup(client, hs)) == {"num_blocks": 5, "media": ["DISK"] * 5}
    assert [p for _, _, p in await get_blocks(client, hs)] == [payload(b) for b in blocks]
    info = msgpack.unpackb(await (await client.get(ns_url())).read())
    assert info["usage"]["DISK"]["blocks"] == 5 and info["block_shape"] == list(SPEC.block_shape)


async def test_durable_put_is_on_disk_when_acknowledged(make_api):
    client = await make_api(durable=True)
    await register(client)
    hs = hashes(4)
    assert await put_blocks(client, hs, random_blocks(SPEC, 4, seed=4)) == [True] * 4
    store = client.server.app[REGISTRY].get("default", NAMESPACE).store
    assert all(h in store.disk for h in hs)


async def test_get_streams_more_blocks_than_the_pool_holds(make_api):
    client = await make_api(cpu_blocks=8, disk_blocks=64)  # loads in chunks of 2 blocks
    await register(client)
    hs, blocks = hashes(40), random_blocks(SPEC, 40, seed=5)
    for start in range(0, 40, 4):
        assert await put_blocks(client, hs[start : start + 4], blocks[start : start + 4]) == [True] * 4
    got = await get_blocks(client, hs)
    assert [p for _, _, p in got] == [payload(b) for b in blocks]
    store = client.server.app[REGISTRY].get("default", NAMESPACE).store
    store.check_invariants()  # every pin of the chunks released


async def test_a_put_frame_with_a_bad_checksum_is_not_stored(make_api):
    client = await make_api()
    await register(client)
    hs, blocks = hashes(3), random_blocks(SPEC, 3, seed=6)
    body = bytearray(frames(NAMESPACE, hs, blocks))
    frame_nbytes = 1 + 32 + HEADER_NBYTES + SPEC.block_nbytes
    body[frame_nbytes + 1 + 32 + HEADER_NBYTES + 7] ^= 0x10  # one payload bit of frame 1
    response = await client.post(ns_url(NAMESPACE, "put"), data=bytes(body))
    assert msgpack.unpackb(await response.read())["stored"] == [True, False, True]
    assert (await lookup(client, hs))["num_blocks"] == 1
    assert client.server.app[REGISTRY].get("default", NAMESPACE).rejected_blocks == 1


# -- case S1: body limits ------------------------------------------------------------------------
def _oversized_header(nbytes: int) -> bytes:
    return encode_header(NAMESPACE, torch.zeros(nbytes, dtype=torch.uint8))


async def test_s1_block_of_exactly_max_bytes_is_stored_one_more_is_413(make_api, put_reads):  # the receiver's path too
    client = await make_api(max_block_bytes=SPEC.block_nbytes)  # M = 512
    await register(client)
    h = hashes(1)
    assert await put_blocks(client, h, random_blocks(SPEC, 1)) == [True]
    body = frame_prefix(hashes(1, salt=1)[0]) + _oversized_header(SPEC.block_nbytes + 1) + bytes(513) + END
    response = await client.post(ns_url(NAMESPACE, "put"), data=body)
    assert response.status == 413 and "max-block-bytes" in (await response.json())["error"]
    assert (await client.get("/healthz")).status == 200


async def test_s1_chunked_body_exactly_max_is_stored(make_api):
    client = await make_api(max_block_bytes=SPEC.block_nbytes)
    await register(client)
    body = frames(NAMESPACE, hashes(1), random_blocks(SPEC, 1))

    async def chunks():
        for i in range(0, len(body), 100):
            yield body[i : i + 100]

    response = await client.post(ns_url(NAMESPACE, "put"), data=chunks())
    assert response.status == 200 and msgpack.unpackb(await response.read())["stored"] == [True]


async def test_s1_chunked_oversized_block_is_refused_before_its_payload_is_sent(make_api):
    client = await make_api(max_block_bytes=SPEC.block_nbytes)
    await register(client)
    payload_sent = asyncio.Event()

    async def chunks():  # no Content-Length: chunked
        yield frame_prefix(hashes(1)[0]) + _oversized_header(SPEC.block_nbytes + 1)
        await asyncio.sleep(30)  # the payload would come now; the 413 must come first
        payload_sent.set()
        yield bytes(SPEC.block_nbytes + 1) + END

    response = await asyncio.wait_for(client.post(ns_url(NAMESPACE, "put"), data=chunks()), 20)
    assert response.status == 413
    assert not payload_sent.is_set()
    response.close()
    assert (await client.get("/healthz")).status == 200


async def test_s1_content_length_over_the_batch_limit_is_refused_unread(make_api, put_reads):  # the receiver's path too
    client = await make_api(max_block_bytes=SPEC.block_nbytes, max_batch_blocks=2)
    await register(client)
    three = frames(NAMESPACE, hashes(3), random_blocks(SPEC, 3))
    response = await client.post(ns_url(NAMESPACE, "put"), data=three)
    assert response.status == 413 and "Content-Length" in (await response.json())["error"]

    async def chunked():
        yield three

    response = await client.post(ns_url(NAMESPACE, "put"), data=chunked())
    assert response.status == 413 and "frames" in (await response.json())["error"]
    assert (await lookup(client, hashes(3)[2:]))["num_blocks"] == 0  # the frame over the limit: not stored
    assert (await client.get("/healthz")).status == 200


async def test_register_a_block_over_the_limit_is_413(make_api):
    client = await make_api(max_block_bytes=SPEC.block_nbytes - 1)
    response = await client.put(ns_url(), data=pack(spec_to_wire(SPEC)))
    assert response.status == 413


# -- bad input: 4xx with a message, and the daemon keeps serving ------------------------------------
def _frame(h=None, header=None, body=None, namespace=NAMESPACE, block=None):
    block = block if block is not None else random_blocks(SPEC, 1, seed=9)[0]
    h = h if h is not None else frame_prefix(hashes(1, salt=9)[0])
    header = header if header is not None else encode_header(namespace, block)
    body = body if body is not None else block.view(torch.uint8).numpy().tobytes()
    return h + header + body


BAD_INPUTS = [
    # (name, method, path, body, status)
    ("lookup: not msgpack", "POST", ns_url(NAMESPACE, "lookup"), b"\xc1\xff garbage", 400),
    ("lookup: empty body", "POST", ns_url(NAMESPACE, "lookup"), b"", 400),
    ("lookup: a list, not a map", "POST", ns_url(NAMESPACE, "lookup"), pack([b"x" * 32]), 400),
    ("lookup: no block_hashes", "POST", ns_url(NAMESPACE, "lookup"), pack({"hashes": []}), 400),
    ("lookup: hash of 20 bytes", "POST", ns_url(NAMESPACE, "lookup"), pack({"block_hashes": [b"x" * 20]}), 400),
    ("lookup: hash as str", "POST", ns_url(NAMESPACE, "lookup"), pack({"block_hashes": ["x" * 32]}), 400),
    ("lookup: hashes not a list", "POST", ns_url(NAMESPACE, "lookup"), pack({"block_hashes": 7}), 400),
    ("lookup: trailing bytes", "POST", ns_url(NAMESPACE, "lookup"), pack({"block_hashes": []}) + b"\x00", 400),
    ("lookup: too many hashes", "POST", ns_url(NAMESPACE, "lookup"), pack({"block_hashes": [b"x" * 32] * 65}), 413),
    ("get: hash of 0 bytes", "POST", ns_url(NAMESPACE, "get"), pack({"block_hashes": [b""]}), 400),
    ("namespace: not hex", "POST", f"/v1/namespaces/{'zz' * 32}/lookup", pack({"block_hashes": []}), 400),
    ("namespace: too short", "POST", "/v1/namespaces/abcd/lookup", pack({"block_hashes": []}), 400),
    ("namespace: unknown", "POST", ns_url(b"\x07" * 32, "lookup"), pack({"block_hashes": []}), 404),
    ("put: unknown namespace", "POST", ns_url(b"\x07" * 32, "put"), END, 404),
    ("register: bad dtype", "PUT", ns_url(b"\x05" * 32), pack({"block_shape": [2, 2, 4, 1, 8], "dtype": "int3"}), 400),
    ("register: 4-d shape", "PUT", ns_url(b"\x05" * 32), pack({"block_shape": [2, 2, 4, 8], "dtype": "float32"}), 400),
    ("register: K/V dim 3", "PUT", ns_url(b"\x05" * 32), pack({"block_shape": [2, 3, 4, 1, 8], "dtype": "float32"}), 400),
    ("register: negative dim", "PUT", ns_url(b"\x05" * 32), pack({"block_shape": [2, 2, -4, 1, 8], "dtype": "float32"}), 400),
    ("register: bools", "PUT", ns_url(b"\x05" * 32), pack({"block_shape": [True, 2, 4, 1, 8], "dtype": "float32"}), 400),
    ("register: not msgpack", "PUT", ns_url(b"\x05" * 32), b"{json: 1}", 400),
    ("register: groups not a list", "PUT", ns_url(b"\x05" * 32), _grouped(groups=7), 400),
    ("register: group with an extra key", "PUT", ns_url(b"\x05" * 32), _grouped(extra=1), 400),
    ("register: unknown kind", "PUT", ns_url(b"\x05" * 32), _grouped(kind="local"), 400),
    ("register: sliding without a window", "PUT", ns_url(b"\x05" * 32), _grouped(window=None), 400),
    ("register: layers not covered", "PUT", ns_url(b"\x05" * 32), _grouped(layers=[0, 5]), 400),
    ("register: layers as strings", "PUT", ns_url(b"\x05" * 32), _grouped(layers=["0"]), 400),
    ("register: bool head dim", "PUT", ns_url(b"\x05" * 32), _grouped(k_head_dim=True), 400),
    ("register: groups without block_size", "PUT", ns_url(b"\x05" * 32), _grouped(block_size=None), 400),
    ("register: groups, wrong block_shape", "PUT", ns_url(b"\x05" * 32), _grouped(block_shape=[480]), 400),
    ("register: 300 groups", "PUT", ns_url(b"\x05" * 32), _grouped(groups=[{}] * 300), 400),
    ("put: hash length 5", "POST", ns_url(NAMESPACE, "put"), b"\x05abcde" + bytes(100), 400),
    ("put: garbage header", "POST", ns_url(NAMESPACE, "put"), _frame(header=b"\x01" * HEADER_NBYTES) + END, 400),
    ("put: other namespace in the record", "POST", ns_url(NAMESPACE, "put"), _frame(namespace=b"\x02" * 32) + END, 400),
    ("put: wrong dtype", "POST", ns_url(NAMESPACE, "put"),
     _frame(block=torch.zeros(SPEC.block_shape, dtype=torch.float16), body=bytes(256)) + END, 400),
    ("put: wrong shape", "POST", ns_url(NAMESPACE, "put"),
     _frame(block=torch.zeros((2, 2, 8, 1, 4)), body=bytes(512)) + END, 400),
    ("put: body ends inside a block", "POST", ns_url(NAMESPACE, "put"), _frame()[:-10], 400),
    ("put: no end byte", "POST", ns_url(NAMESPACE, "put"), _frame(), 400),
    ("put: bytes after the end byte", "POST", ns_url(NAMESPACE, "put"), _frame() + END + b"more", 400),
    ("put: empty body", "POST", ns_url(NAMESPACE, "put"), b"", 400),
    ("method not allowed", "PATCH", ns_url(NAMESPACE), b"", 405),
    ("no such route", "GET", "/v1/nothing", b"", 404),
    ("body over client_max_size", "POST", ns_url(NAMESPACE, "lookup"), bytes(64 * 64 + (64 << 10) + 1), 413),
]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
async def test_bad_input_is_4xx_with_a_message_and_the_daemon_keeps_serving(make_api, case):
    _, method, path, body, status = case
    client = await make_api(max_batch_blocks=64)
    await register(client)
    hs, blocks = hashes(2), random_blocks(SPEC, 2, seed=10)
    await put_blocks(client, hs, blocks)

    response = await client.request(method, path, data=body)
    assert response.status == status, await response.text()
    assert response.content_type == "application/json"
    assert (await response.json())["error"]

    assert (await client.get("/healthz")).status == 200
    assert [p for _, _, p in await get_blocks(client, hs)] == [payload(b) for b in blocks]  # nothing lost
    client.server.app[REGISTRY].get("default", NAMESPACE).store.check_invariants()


async def test_media_report_the_fastest_tier(make_api):
    client = await make_api(cpu_blocks=4, disk_blocks=64)
    await register(client)
    hs = hashes(8)
    for start in range(0, 8, 2):
        await put_blocks(client, hs[start : start + 2], random_blocks(SPEC, 2, seed=start))
    media = (await lookup(client, hs))["media"]
    assert len(media) == 8 and set(media) == {str(Medium.CPU), str(Medium.DISK)}
    assert media[:2] == ["DISK", "DISK"]  # the oldest blocks spilled


# -- auth ----------------------------------------------------------------------------------------
async def test_token_is_required_except_for_healthz_and_openapi(make_api):
    client = await make_api(token="s3cret")
    assert (await client.get("/healthz")).status == 200
    assert (await client.get("/openapi.json")).status == 200
    body = pack(spec_to_wire(SPEC))
    missing = await client.put(ns_url(), data=body)
    assert missing.status == 401 and missing.headers["WWW-Authenticate"].startswith("Bearer")
    assert (await client.put(ns_url(), data=body, headers={"Authorization": "Bearer s3cre"})).status == 401
    assert (await client.put(ns_url(), data=body, headers={"Authorization": "Basic s3cret"})).status == 401
    assert (await client.put(ns_url(), data=body, headers={"Authorization": "Bearer s3cret"})).status == 201


def test_non_loopback_without_token_refuses_to_start(tmp_path, monkeypatch):
    monkeypatch.delenv("KVTIER_TOKEN", raising=False)
    result = CliRunner().invoke(main, ["serve", "--host", "0.0.0.0", "--data-dir", str(tmp_path)])
    assert result.exit_code == 2 and "without a token" in result.output
    with pytest.raises(ValueError, match="without a token"):
        ServeConfig(host="10.1.2.3").check_bind()
    ServeConfig(host="10.1.2.3", token="t").check_bind()
    ServeConfig(host="localhost").check_bind()
    ServeConfig(host="::1").check_bind()


def test_token_comes_from_the_environment(tmp_path):
    from kvtier.config import StoreConfig

    settings = ServeConfig.from_options(StoreConfig(data_dir=tmp_path), {"host": "0.0.0.0"}, {"KVTIER_TOKEN": "abc"})
    assert settings.token == "abc"
    settings.check_bind()


async def test_a_second_daemon_on_the_same_data_dir_is_refused(make_api, tmp_path):
    settings = serve_settings(tmp_path / "data")
    await make_api(settings)
    with pytest.raises(RuntimeError, match="another kvtier serve"):
        await make_api(settings)


async def test_openapi_describes_every_route(make_api):
    from kvtier.server.openapi import openapi

    client = await make_api()
    doc = await (await client.get("/openapi.json")).json()
    assert doc["openapi"].startswith("3.")
    routes = {(r.method, r.resource.canonical) for r in client.server.app.router.routes() if r.method != "HEAD"}
    described = {(m.upper(), p) for p, item in doc["paths"].items() for m in item if m != "parameters"}
    assert routes == described
    own = {(m.upper(), p) for p, item in openapi(client.server.app[SETTINGS])["paths"].items()
           for m in item if m != "parameters"}  # written out in full, not the minimal entries
    assert {("PUT", "/v1/namespaces/{ns}"), ("POST", "/v1/namespaces/{ns}/get"),
            ("POST", "/v1/namespaces/{ns}/put"), ("POST", "/v1/namespaces/{ns}/lookup"),
            ("DELETE", "/v1/namespaces/{ns}"), ("GET", "/v1/namespaces/{ns}"), ("GET", "/healthz"),
            ("GET", "/openapi.json"), ("POST", "/v1/auth/hello"), ("POST", "/v1/namespaces/{ns}/reset"),
            ("GET", "/v1/admin/namespaces"), ("POST", "/v1/admin/reset"),
            ("DELETE", "/v1/admin/tenants/{tenant}/namespaces/{ns}"),
            ("POST", "/v1/admin/tenants/{tenant}/namespaces/{ns}/reset")} == own


async def test_namespaces_of_the_layout_before_tenants_move_to_tenant_default_and_hit(make_api, tmp_path):
    """A data directory of a daemon before tenants (``<data_dir>/<hex>/spec.msgpack + disk/``)
    is moved to ``tenants/default/`` on start, its blocks still hits."""
    settings = serve_settings(tmp_path / "data")
    client = await make_api(settings)
    await register(client)
    hs, blocks = hashes(4), random_blocks(SPEC, 4, seed=6)
    await put_blocks(client, hs, blocks)
    await client.close()
    old = tmp_path / "data" / NAMESPACE.hex()
    ns_dir(tmp_path / "data").rename(old)
    (old / MARKER_FILE).unlink()

    client = await make_api(settings)
    assert (await lookup(client, hs)) == {"num_blocks": 4, "media": ["DISK"] * 4}
    assert not old.exists() and (ns_dir(tmp_path / "data") / MARKER_FILE).is_file()


async def test_one_middleware_keeps_every_layer_a_500_is_json_and_the_call_ends(make_api, monkeypatch, caplog):
    """The four middlewares run as one (issue 17): an unexpected exception in a handler is a
    JSON 500 (logged) and the daemon keeps serving; a 404 of the router and a guard refusal
    are JSON; a bad hash is still a 400 after the merge."""
    import kvtier.server.app as app_module

    client = await make_api()
    await register(client)

    def boom(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(app_module, "describe", boom)  # GET /v1/namespaces/{ns} calls it
    response = await client.get(ns_url())
    assert response.status == 500
    assert (await response.json())["error"] == "internal error: RuntimeError: a bug"
    assert any("failed" in r.getMessage() for r in caplog.records)
    monkeypatch.undo()
    response = await client.post(ns_url(op="lookup"), data=pack({"block_hashes": hashes(2)}))
    assert response.status == 200 and msgpack.unpackb(await response.read())["num_blocks"] == 0
    response = await client.post(ns_url(op="lookup"), data=pack({"block_hashes": [b"x" * 31]}))
    assert response.status == 400 and "16 or 32 bytes" in (await response.json())["error"]
    response = await client.get("/v1/nothing-here")
    assert response.status == 404 and "error" in await response.json()
    response = await client.post(ns_url(op="lookup"), data=b"x", headers={"Content-Type": "text/plain"})
    assert response.status == 415 and "Content-Type" in (await response.json())["error"]


async def test_a_second_empty_put_body_is_a_400_too(make_api):
    """aiohttp hands every request without a body the same ``EMPTY_PAYLOAD`` reader, whose
    ``readchunk`` answers ``(b"", True)`` forever once it was read to its end: the second
    empty put in a process spun the event loop in ``next_chunk`` (a suite hung there)."""
    client = await make_api()
    await register(client)
    for _ in range(3):
        response = await asyncio.wait_for(client.post(ns_url(NAMESPACE, "put"), data=b""), 10)
        assert response.status == 400, await response.text()
        assert "ends inside a frame" in (await response.json())["error"]
    assert (await client.get("/healthz")).status == 200


async def test_a_lookup_while_another_thread_holds_the_stores_lock_waits_off_the_loop(make_api):
    # lookups are answered on the loop only when the store's lock is free (lookup_now); a busy
    # lock sends the call to the registry's threads, and the loop keeps serving meanwhile
    client = await make_api()
    await register(client)
    hs, blocks = hashes(4), random_blocks(SPEC, 4, seed=5)
    assert await put_blocks(client, hs[:3], blocks[:3]) == [True] * 3
    store = client.app[REGISTRY].get("default", NAMESPACE).store
    async with _lock_held(store):
        pending = asyncio.ensure_future(lookup(client, hs))
        await asyncio.sleep(0.2)
        assert not pending.done()  # waiting for the lock, on a registry thread
        health = await client.get("/healthz")  # the loop is free
        assert health.status == 200 and not pending.done()
    assert await pending == {"num_blocks": 3, "media": ["CPU"] * 3}
    assert store.stats.lookup_blocks == 4  # counted once, by the call that waited


@pytest.mark.parametrize("route", ["channel", "http"])
async def test_a_lookup_waiting_for_its_store_when_the_namespace_is_deleted_is_a_409_not_a_cut_connection(
    make_api, route
):
    # the wait runs in a task of its own, which the delete cuts (found in review, 2026-12-03:
    # it was the caller's task, so the delete closed the whole channel and every later frame
    # on it, other namespaces' too)
    import aiohttp

    client = await make_api()
    other = bytes(range(1, 33))
    await register(client)
    await register(client, other)
    hs = hashes(2)
    assert await put_blocks(client, hs, random_blocks(SPEC, 2, seed=6), other) == [True, True]
    store = client.app[REGISTRY].get("default", NAMESPACE).store
    frame = lambda ns: pack({"op": "lookup", "namespace": ns.hex(), "block_hashes": hs})  # noqa: E731
    ws = await client.ws_connect("/v1/channel", protocols=("kvtier.v1",)) if route == "channel" else None
    async with _lock_held(store):
        if ws is not None:
            await ws.send_bytes(frame(NAMESPACE))
        else:
            waiting = asyncio.ensure_future(client.post(ns_url(NAMESPACE, "lookup"), data=pack({"block_hashes": hs})))
        await asyncio.sleep(0.2)  # on a registry thread, waiting for the lock
        deleting = asyncio.ensure_future(client.delete(ns_url(NAMESPACE)))
        await asyncio.sleep(0.2)
    assert (await deleting).status == 200
    if ws is not None:
        reply = await ws.receive()
        assert reply.type is aiohttp.WSMsgType.BINARY
        assert msgpack.unpackb(reply.data)["status"] == 409
        await ws.send_bytes(frame(other))  # the same connection serves on
        assert msgpack.unpackb((await ws.receive()).data) == {"num_blocks": 2, "media": ["CPU"] * 2}
        await ws.close()
    else:
        response = await waiting
        assert response.status == 409 and "deleted or reset" in (await response.json())["error"]
        assert await lookup(client, hs, other) == {"num_blocks": 2, "media": ["CPU"] * 2}


@contextlib.asynccontextmanager
async def _lock_held(store):
    """``store``'s lock held by another thread for the block's duration."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with store.residency.lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(5)
        yield
    finally:
        release.set()
        await asyncio.to_thread(holder.join)
