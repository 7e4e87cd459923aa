"""kvtier.kernels.host_copy: the compiled host copies (streaming stores) give exactly numpy's
bytes for every layout they accept, refuse bad indices before writing, and fall back (return
``False``) when they cannot be built; the HF gather and the DISK reads give the same bytes
either way."""

from __future__ import annotations

import ctypes
import logging

import numpy as np
import pytest
import torch

import xxhash

from kvtier.kernels import host_copy
from kvtier.records import HEADER_NBYTES, decode_into, decode_into_view, encode_record

pytestmark = pytest.mark.skipif(not host_copy.available(), reason="no C compiler: the numpy fallback runs instead")


@pytest.fixture(params=["streaming", "memcpy"])
def streaming(request, monkeypatch):
    """Both store paths of the kernel: streaming stores (threshold 0) and ``memcpy``."""
    monkeypatch.setattr(host_copy, "STREAMING_MIN_NBYTES", 0 if request.param == "streaming" else 1 << 62)
    return request.param


@pytest.fixture
def kernels_off(monkeypatch):
    monkeypatch.setattr(host_copy, "_library", None)
    monkeypatch.setattr(host_copy, "_loaded", True)


def _bytes(shape, seed):
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def _at(offset, shape):
    """A C-contiguous zeroed uint8 array starting ``offset`` bytes past a 64-byte boundary."""
    n = int(np.prod(shape))
    base = np.zeros(n + 128, np.uint8)
    start = (-base.ctypes.data) % 64 + offset
    return base[start : start + n].reshape(shape)


# piece sizes: under 64 bytes (memcpy only), odd, a 16-byte multiple, SmolLM2's 4 KiB plus a tail
@pytest.mark.parametrize("piece", [24, 100, 4096, 4096 + 7])
@pytest.mark.parametrize("offset", [0, 3, 16])
def test_gather_blocks_equals_numpy_per_block(streaming, piece, offset):
    rows, n, num_slots = 6, 9, 13
    pool = _bytes((num_slots, rows, piece), piece + offset)
    rng = np.random.default_rng(offset)
    slots = [int(s) for s in rng.permutation(num_slots)[:7]]
    positions = [int(p) for p in rng.permutation(n)[:7]]
    out = _at(offset, (rows, n, piece))
    expected = out.copy()
    for s, p in zip(slots, positions):
        expected[:, p] = pool[s]
    assert host_copy.gather_blocks(out, pool, slots, positions) is True
    assert np.array_equal(out, expected)


@pytest.mark.parametrize("bad", [
    dict(slots=[0, 13]), dict(slots=[-1, 0]), dict(positions=[0, 9]), dict(positions=[-2, 0]),
    dict(positions=[0]),
])
def test_gather_blocks_refuses_out_of_range_indices_before_writing(bad):
    pool = _bytes((13, 4, 64), 0)
    out = np.zeros((4, 9, 64), np.uint8)
    args = dict(slots=[1, 2], positions=[3, 4]) | bad
    with pytest.raises(ValueError, match="expected"):
        host_copy.gather_blocks(out, pool, args["slots"], args["positions"])
    assert not out.any()  # nothing written


def test_gather_blocks_refuses_other_shapes_and_layouts():
    pool = _bytes((4, 3, 64), 0)
    with pytest.raises(ValueError, match="pool"):
        host_copy.gather_blocks(np.zeros((3, 2, 32), np.uint8), pool, [0], [0])
    with pytest.raises(ValueError, match="uint8"):
        host_copy.gather_blocks(np.zeros((3, 2, 16), np.float32), pool, [0], [0])
    with pytest.raises(ValueError, match="contiguous"):
        host_copy.gather_blocks(np.zeros((3, 4, 64), np.uint8)[:, ::2], pool, [0], [0])
    assert host_copy.gather_blocks(np.zeros((3, 2, 64), np.uint8), pool, [], []) is True


def test_row_layout_of_block_views_and_refusals():
    buffer = np.zeros((30, 2, 3, 64, 256), np.uint8)  # [L, 2, H, tokens, head_dim bytes]
    blocks = buffer.reshape(30, 2, 3, 4, 16, 256)
    assert host_copy.row_layout(blocks[:, :, :, 1]) == (180, 16 * 256, 64 * 256)
    assert host_copy.row_layout(buffer) == (1, buffer.size, buffer.size)
    assert host_copy.row_layout(buffer[:1, :1, :1, :16]) == (1, 16 * 256, 16 * 256)
    assert host_copy.row_layout(buffer[:, :, :, :16, :128]) is None  # two strides: not rows
    assert host_copy.row_layout(buffer.reshape(-1, 256).T) is None  # transposed
    assert host_copy.row_layout(np.broadcast_to(np.zeros(64, np.uint8), (4, 64))) is None  # stride 0
    assert host_copy.row_layout(buffer.view(np.float32)) is None  # not bytes


@pytest.mark.parametrize("offset", [0, 5])
def test_copy_into_rows_equals_numpy(streaming, offset):
    buffer = _at(offset, (30, 2, 3, 4 * 16, 256))
    place = buffer.reshape(30, 2, 3, 4, 16, 256)[:, :, :, 2]  # one block's place in a hit buffer
    src = _bytes(place.size, offset)
    assert host_copy.copy_into(place, src) is True
    expected = np.zeros_like(buffer)
    expected.reshape(30, 2, 3, 4, 16, 256)[:, :, :, 2] = src.reshape(place.shape)
    assert np.array_equal(buffer, expected)  # the block's place and nothing else
    contiguous = _at(offset, (1000 + offset,))
    assert host_copy.copy_into(contiguous, src[: contiguous.size]) is True
    assert np.array_equal(contiguous, src[: contiguous.size])


def test_copy_into_leaves_other_layouts_to_numpy_and_checks_its_source():
    dst = np.zeros((64, 32), np.uint8).T
    assert host_copy.copy_into(dst, _bytes(dst.size, 0)) is False and not dst.any()
    with pytest.raises(ValueError, match="source"):
        host_copy.copy_into(np.zeros(8, np.uint8), np.zeros(9, np.uint8))
    with pytest.raises(ValueError, match="writable"):
        host_copy.copy_into(np.frombuffer(bytes(8), np.uint8), np.zeros(8, np.uint8))  # read-only
    with pytest.raises(ValueError, match="source of 96 bytes"):
        host_copy.copy_rows(np.zeros(200, np.uint8).ctypes.data, (3, 32, 64), np.zeros(95, np.uint8))
    dst = np.zeros(200, np.uint8)
    assert host_copy.copy_rows(dst.ctypes.data, (3, 32, 64), np.ones(96, np.uint8)) is True
    assert dst.reshape(-1)[[0, 31, 64, 95, 128, 159]].all() and not dst[32:64].any() and not dst[160:].any()


@pytest.mark.parametrize("kernels", ["compiled", "numpy"])
def test_the_hf_gather_is_the_same_with_or_without_the_kernels(request, monkeypatch, kernels):
    from kvtier.connectors.hf_cache import gather_into
    from kvtier.types import KVSpec

    if kernels == "numpy":
        request.getfixturevalue("kernels_off")
    monkeypatch.setattr(host_copy, "STREAMING_MIN_NBYTES", 0)
    spec = KVSpec(num_layers=2, num_kv_heads=3, head_dim=8, block_size=4, dtype=torch.bfloat16, head_major=True)
    pool = torch.randn(6, *spec.block_shape).to(torch.bfloat16)
    out = torch.zeros(spec.num_layers, 2, spec.num_kv_heads, 3 * spec.block_size, spec.head_dim, dtype=torch.bfloat16)
    gather_into(spec, pool, out, [4, 1, 5], [2, 0, 1])
    for slot, position in ((4, 2), (1, 0), (5, 1)):
        assert torch.equal(out[..., position * 4 : (position + 1) * 4, :], pool[slot])


def test_unavailable_kernels_copy_nothing_and_the_callers_fall_back(kernels_off):
    from kvtier.connectors.hf_cache import gather_into
    from kvtier.types import KVSpec

    assert host_copy.available() is False
    assert host_copy.gather_blocks(np.zeros((1, 1, 64), np.uint8), _bytes((1, 1, 64), 0), [0], [0]) is False
    assert host_copy.copy_into(np.zeros(64, np.uint8), _bytes(64, 0)) is False
    spec = KVSpec(num_layers=2, num_kv_heads=3, head_dim=8, block_size=4, dtype=torch.float32, head_major=True)
    pool = torch.randn(6, *spec.block_shape)
    out = torch.zeros(spec.num_layers, 2, spec.num_kv_heads, 3 * spec.block_size, spec.head_dim)
    gather_into(spec, pool, out, [4, 1], [2, 0])
    assert torch.equal(out[..., 2 * spec.block_size :, :], pool[4])
    assert torch.equal(out[..., : spec.block_size, :], pool[1])


@pytest.mark.parametrize("kernels", ["compiled", "compiled, python-xxhash", "numpy"])
def test_records_decode_the_same_bytes_with_or_without_the_kernels(request, monkeypatch, kernels):
    if kernels == "numpy":
        request.getfixturevalue("kernels_off")
    if kernels == "compiled, python-xxhash":  # the copies compiled, the hash python-xxhash's (no exported xxh3)
        monkeypatch.setattr(host_copy, "_hashing", False)
    monkeypatch.setattr(host_copy, "STREAMING_MIN_NBYTES", 0)
    block = torch.randn(2, 2, 3, 16, 8)
    record = memoryview(encode_record(b"n" * 32, block, 1))
    out = torch.full_like(block, 7.0)
    assert decode_into(record, b"n" * 32, out).value == "ok" and torch.equal(out, block)
    hit = torch.zeros(2, 2, 3, 48, 8)  # three blocks' places, head-major
    place = hit.view(2, 2, 3, 3, 16, 8)[:, :, :, 1]
    assert decode_into_view(record, b"n" * 32, place).value == "ok"
    assert torch.equal(hit[:, :, :, 16:32], block) and not hit[:, :, :, :16].any() and not hit[:, :, :, 32:].any()


def test_a_failed_build_or_off_falls_back_with_a_log(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(host_copy, "_library", None)
    monkeypatch.setattr(host_copy, "_loaded", False)
    monkeypatch.setenv(host_copy.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    with caplog.at_level(logging.WARNING, logger="kvtier.kernels.host_copy"):
        assert host_copy.library() is None
    assert "not built" in caplog.text and not list((tmp_path / "cache").glob("*.so"))
    monkeypatch.setattr(host_copy, "_loaded", False)
    monkeypatch.setenv(host_copy.ENV, "off")
    assert host_copy.library() is None


def test_the_build_is_cached_per_source_and_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv(host_copy.CACHE_ENV, str(tmp_path))
    first = host_copy._build()
    assert first is not None and first.parent == tmp_path and first.is_file()
    mtime = first.stat().st_mtime_ns
    assert host_copy._build() == first and first.stat().st_mtime_ns == mtime  # not compiled again
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no partial file left
    assert first.stat().st_mode & 0o777 == 0o755  # never group- or world-writable (_untrusted)


def test_decode_into_view_plans_by_layout_not_by_shape(monkeypatch):
    # decode_into_view keeps what it copies by per (dtype, shape, strides): places of one block
    # shape in hit buffers of other lengths (other strides) must each get their own rows
    monkeypatch.setattr(host_copy, "STREAMING_MIN_NBYTES", 0)
    block = torch.randn(2, 2, 3, 16, 8)
    record = memoryview(encode_record(b"n" * 32, block, 1))
    for blocks_in_buffer in (3, 5, 3, 2, 5):
        hit = torch.zeros(2, 2, 3, 16 * blocks_in_buffer, 8)
        place = hit.view(2, 2, 3, blocks_in_buffer, 16, 8)[:, :, :, 1]
        assert decode_into_view(record, b"n" * 32, place).value == "ok"
        assert torch.equal(hit[:, :, :, 16:32], block)
        hit[:, :, :, 16:32] = 0
        assert not hit.any()  # nothing outside the block's place
    wrong = torch.zeros(2, 2, 3, 16, 4)  # another shape: refused, not copied
    assert decode_into_view(record, b"n" * 32, wrong).value == "corrupt" and not wrong.any()


# -- from the hostile review of the first version ---------------------------------------------
@pytest.mark.parametrize("slots, positions", [(np.array([np.nan]), [0]), ([0], np.array([np.nan])), ([2.9], [0])])
def test_gather_blocks_refuses_indices_that_are_not_integers(slots, positions):
    pool, out = _bytes((4, 1, 63), 0), np.zeros((1, 3, 63), np.uint8)
    with pytest.raises(ValueError, match="integer"):
        host_copy.gather_blocks(out, pool, slots, positions)
    assert not out.any()
    assert host_copy.gather_blocks(out, pool, np.array([3], np.uint16), np.array([True])) is True
    assert np.array_equal(out[:, 1], pool[3])


def test_overlapping_source_and_destination_are_left_to_numpy(streaming):
    a = np.arange(200, dtype=np.uint8)
    assert host_copy.copy_into(a[1:], a[:-1]) is False  # numpy's copy handles the overlap
    assert host_copy.copy_rows(a[16:].ctypes.data, (1, 150, 150), a[:150]) is False
    assert np.array_equal(a, np.arange(200, dtype=np.uint8))  # nothing written
    pool = _bytes((4, 2, 64), 0)
    before = pool.copy()
    assert host_copy.gather_blocks(pool[2:4], pool, [0, 1], [0, 1]) is False  # out inside the pool
    assert np.array_equal(pool, before)
    assert host_copy.gather_blocks(pool[2:4].copy(), pool, [0, 1], [0, 1]) is True


def test_decode_into_view_never_writes_past_a_destinations_storage():
    block = torch.randn(2, 3, 16, 8)
    record = memoryview(encode_record(b"n" * 32, block, 1))
    assert decode_into_view(record, b"n" * 32, torch.empty(2, 3, 16, 8)).value == "ok"  # a plan for the layout
    gone = torch.zeros(2, 3, 16, 8)
    gone.untyped_storage().resize_(0)
    with pytest.raises(ValueError, match="inside its storage"):
        decode_into_view(record, b"n" * 32, gone)
    with pytest.raises((TypeError, RuntimeError)):  # not host memory: numpy's path refuses it
        decode_into_view(record, b"n" * 32, torch.empty(2, 3, 16, 8, device="meta"))


def test_a_bad_compiler_command_or_a_damaged_library_never_raises_into_callers(tmp_path, monkeypatch):
    monkeypatch.setattr(host_copy, "_library", None)
    monkeypatch.setattr(host_copy, "_loaded", False)
    monkeypatch.setenv(host_copy.CACHE_ENV, str(tmp_path / "a"))
    monkeypatch.setenv("CC", 'gcc "')  # shlex: no closing quotation
    assert host_copy.library() is None and host_copy.library() is None  # logged once, not retried
    block = torch.randn(2, 3, 16, 8)
    out = torch.zeros_like(block)
    assert decode_into(memoryview(encode_record(b"n" * 32, block, 1)), b"n" * 32, out).value == "ok"
    assert torch.equal(out, block)
    # a truncated library in the cache is built again
    monkeypatch.delenv("CC")
    monkeypatch.setattr(host_copy, "_loaded", False)
    monkeypatch.setenv(host_copy.CACHE_ENV, str(tmp_path / "b"))
    built = host_copy._build()
    built.write_bytes(built.read_bytes()[:100])
    assert host_copy.library() is not None and built.stat().st_size > 100


def test_a_library_others_can_write_is_not_loaded(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(host_copy, "_library", None)
    monkeypatch.setattr(host_copy, "_loaded", False)
    shared = tmp_path / "shared"
    monkeypatch.setenv(host_copy.CACHE_ENV, str(shared))
    host_copy._build()
    shared.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="kvtier.kernels.host_copy"):
        assert host_copy.library() is None
    assert "writable by" in caplog.text


needs_hashing = pytest.mark.skipif(not host_copy._hashing, reason="python-xxhash exports no xxh3: records are hashed by python-xxhash, then copied")


@needs_hashing
@pytest.mark.parametrize("rows, row_nbytes, chunk", [(1, 300_001, 4096), (1, 300_001, 1 << 20), (37, 4096, 16384),
                                                     (37, 4103, 4096), (5, 24, 64), (3, 0, 64)])
@pytest.mark.parametrize("offset", [0, 3])
def test_hash_copy_rows_hashes_as_xxhash_and_copies_as_numpy(streaming, monkeypatch, rows, row_nbytes, chunk, offset):
    # both loops of the kernel: rows longer than a chunk (hashed and copied in chunks) and
    # rows shorter (whole rows a chunk), each row to its place in a larger buffer
    monkeypatch.setattr(host_copy, "HASH_CHUNK_NBYTES", chunk)
    src = _bytes(rows * row_nbytes, rows + row_nbytes)
    prefix = _bytes(120, offset)
    out = _at(offset, (rows, row_nbytes + 40))
    digest = host_copy.hash_copy_rows(out.ctypes.data, (rows, row_nbytes, row_nbytes + 40), src, prefix)
    assert digest == xxhash.xxh3_64(prefix.tobytes() + src.tobytes()).intdigest()
    assert np.array_equal(out[:, :row_nbytes], src.reshape(rows, row_nbytes)) and not out[:, row_nbytes:].any()


@needs_hashing
def test_hash_copy_rows_copies_nothing_without_the_bound_hash_or_into_its_source(monkeypatch):
    src = _bytes(8192, 1)
    out = np.zeros(8192, np.uint8)
    with pytest.raises(ValueError, match="contiguous uint8"):
        host_copy.hash_copy_rows(out.ctypes.data, (2, 4096, 4096), src[:4096], _bytes(120, 0))
    assert host_copy.hash_copy_rows(src.ctypes.data + 100, (2, 4096, 4096), src, _bytes(120, 0)) is None  # overlap
    monkeypatch.setattr(host_copy, "_hashing", False)
    assert host_copy.hash_copy_rows(out.ctypes.data, (2, 4096, 4096), src, _bytes(120, 0)) is None
    assert not out.any()


def test_the_fused_hash_is_bound_wherever_python_xxhash_exports_xxh3():
    # the load-time check (_bind_xxh3) refuses a kernel that hashes wrong; here a refusal fails
    # instead of skipping the fused tests wherever python-xxhash exports what it needs
    import xxhash._xxhash as extension

    exported = ctypes.CDLL(extension.__file__)
    if not all(any(hasattr(exported, name) for name in names) for names in host_copy._XXH3_SYMBOLS):
        pytest.skip("this python-xxhash exports no xxh3: DISK reads hash with python-xxhash, then copy")
    assert host_copy._hashing is True


@needs_hashing
def test_xxh3_bound_only_when_it_hashes_as_python_xxhash(monkeypatch, caplog):
    lib = host_copy.library()
    try:
        # a function that is not xxh3's update (reset ignores the data): the check refuses it
        monkeypatch.setattr(host_copy, "_XXH3_SYMBOLS", (("XXH3_createState",), ("XXH3_freeState",),
                                                         ("XXH3_64bits_reset",), ("XXH3_64bits_reset",),
                                                         ("XXH3_64bits_digest",)))
        with caplog.at_level(logging.WARNING, logger="kvtier.kernels.host_copy"):
            assert host_copy._bind_xxh3(lib) is False
        assert "failed kvtier's check" in caplog.text
        digest = ctypes.c_uint64()
        assert lib.kvt_hash_copy_rows(ctypes.byref(digest), None, 0, None, 0, None, 0, 0, 64, 0) == -1  # unbound
        monkeypatch.setattr(host_copy, "_XXH3_SYMBOLS", (("XXH3_no_such_symbol",),) * 5)
        assert host_copy._bind_xxh3(lib) is False  # an extension that exports none: python-xxhash, then the copy
    finally:
        monkeypatch.undo()
        assert host_copy._bind_xxh3(lib) is True


@needs_hashing
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("decoder", [decode_into, decode_into_view])
def test_a_byte_flipped_in_any_chunk_of_the_payload_is_corrupt(monkeypatch, where, decoder):
    monkeypatch.setattr(host_copy, "HASH_CHUNK_NBYTES", 4096)  # 12 chunks
    block = torch.randn(2, 2, 3, 16, 8)  # 6 KiB a K/V half, 48 KiB in all
    record = bytearray(encode_record(b"n" * 32, block, 1))
    out = torch.zeros_like(block)
    assert decoder(memoryview(bytes(record)), b"n" * 32, out).value == "ok" and torch.equal(out, block)
    payload = len(record) - HEADER_NBYTES
    record[HEADER_NBYTES + {"first": 5, "middle": payload // 2, "last": payload - 1}[where]] ^= 1
    assert decoder(memoryview(bytes(record)), b"n" * 32, torch.zeros_like(block)).value == "corrupt"


@needs_hashing
def test_hash_copy_blocks_is_hash_copy_rows_for_each_block(streaming, monkeypatch):
    monkeypatch.setattr(host_copy, "HASH_CHUNK_NBYTES", 4096)
    rows, row_nbytes, stride = 7, 1000, 1064
    records = [_bytes(128 + rows * row_nbytes, seed) for seed in range(5)]
    out = np.zeros((5, rows, stride), np.uint8)
    order = [3, 0, 4, 1, 2]  # block b to place order[b]
    addresses = np.array([out[k].ctypes.data for k in order], dtype=np.int64)
    digests = host_copy.hash_copy_blocks(addresses, (rows, row_nbytes, stride), records, 120, 128)
    assert digests.tolist() == [xxhash.xxh3_64(r[:120].tobytes() + r[128:].tobytes()).intdigest() for r in records]
    for b, k in enumerate(order):
        assert np.array_equal(out[k, :, :row_nbytes], records[b][128:].reshape(rows, row_nbytes))
    assert not out[:, :, row_nbytes:].any()


@needs_hashing
def test_hash_copy_blocks_checks_its_records_and_leaves_overlap_and_no_hash_to_the_caller(monkeypatch):
    records = [_bytes(128 + 4096, 0), _bytes(128 + 4096, 1)]
    out = np.zeros((2, 4096), np.uint8)
    addresses = np.array([out[0].ctypes.data, out[1].ctypes.data], dtype=np.int64)
    with pytest.raises(ValueError, match="contiguous uint8"):
        host_copy.hash_copy_blocks(addresses, (1, 4096, 4096), [records[0], records[1][:-1]], 120, 128)
    with pytest.raises(ValueError, match="one destination per record"):
        host_copy.hash_copy_blocks(addresses[:1], (1, 4096, 4096), records, 120, 128)
    inside = np.array([records[1].ctypes.data + 200, out[1].ctypes.data], dtype=np.int64)
    assert host_copy.hash_copy_blocks(inside, (1, 4096, 4096), records, 120, 128) is None  # into a record
    monkeypatch.setattr(host_copy, "_hashing", False)
    assert host_copy.hash_copy_blocks(addresses, (1, 4096, 4096), records, 120, 128) is None
    assert not out.any()


@needs_hashing
@pytest.mark.parametrize("chunk", [0, -1])
def test_a_chunk_size_that_is_not_positive_is_refused_not_run(monkeypatch, chunk):
    # from a hostile review: 0 looped forever in C, -1 crashed
    monkeypatch.setattr(host_copy, "HASH_CHUNK_NBYTES", chunk)
    src, out = _bytes(4096, 0), np.zeros(4096, np.uint8)
    with pytest.raises(ValueError, match="HASH_CHUNK_NBYTES"):
        host_copy.hash_copy_rows(out.ctypes.data, (1, 4096, 4096), src, _bytes(120, 1))
    with pytest.raises(ValueError, match="HASH_CHUNK_NBYTES"):
        host_copy.hash_copy_blocks(np.array([out.ctypes.data]), (1, 3968, 3968), [src], 120, 128)
    assert not out.any()
