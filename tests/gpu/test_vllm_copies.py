"""CUDA ordering of the vLLM connector's staged copies (``kvtier.connectors.vllm.copies``):
pinned CPU pool <-> device staging buffers (side stream) <-> vLLM's paged caches (Triton, the
compute stream), on FLASH_ATTN caches in vLLM 0.32's layouts.

What goes wrong on a GPU when a copy is not ordered, and the test that pins it down (each on
the default stream and on a non-default compute stream):

- a save that reads a block before the forward's write to it landed (the write queued behind
  slow work): the pool gets the old bytes. ``test_save_waits_for_the_forward``;
- a load whose gather runs before its H2D landed, or a reader of the cache that runs before
  the gather: ``test_load_is_in_before_the_next_kernel``;
- a staging buffer reused while the copy out of it still runs (one block per buffer, many
  chunks, loads and saves interleaved): ``test_staging_buffers_are_reused_only_when_free``;
- the worker publishing a save, or releasing a load's pool slots, before the copies finished:
  ``test_fence_done_means_the_pool_side_finished``.

Blocks are filled with values that differ per iteration, the targets poisoned first.
"""

from __future__ import annotations

import torch

from kvtier.connectors.vllm.copies import PagedCopies
from kvtier.connectors.vllm.layout import flash_block_views, kv_spec_for_caches
from tests.unit.connectors.vllm_layouts import layer_caches
from tests.gpu.conftest import GPU_ONLY, HAS_CUDA

pytestmark = GPU_ONLY

LAYERS, NUM_PAGED, HEADS, BLOCK, HEAD = 4, 64, 8, 16, 128  # Llama-3-8B's heads, 4 layers
ITERATIONS = 200 if HAS_CUDA else 4  # on the CPU (KVTIER_GPU_TESTS_ON_CPU=1) copies are synchronous


def setup(device: torch.device, layout: str = "BLNHC", blocks_per_buffer: int = 8, pool_blocks: int = 64):
    """Caches on ``device`` in ``layout``, a (pinned) CPU pool, and the staged copies."""
    base = layer_caches(layout, LAYERS, NUM_PAGED, HEADS, BLOCK, HEAD, fill=0.0)
    root = base[0]._base
    moved = root.to(device)
    caches = [torch.as_strided(moved, c.shape, c.stride(), c.storage_offset()) for c in base]
    views = [flash_block_views(c, BLOCK, HEAD) for c in caches]
    spec = kv_spec_for_caches(caches, BLOCK)
    pool = torch.zeros((pool_blocks, *spec.block_shape), dtype=spec.dtype, pin_memory=device.type == "cuda")
    copies = PagedCopies(pool, [k for k, _ in views], [v for _, v in views],
                         staging_bytes=2 * blocks_per_buffer * spec.block_nbytes, staged=True)
    return copies, views


def value(i: int, j: int) -> float:
    """Block ``j`` of iteration ``i``: exact in bf16, never the previous iteration's, never -1."""
    return float((i * 16 + j) % 251 + 1)


def settle(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def test_save_waits_for_the_forward(device, compute_stream, slow_work) -> None:
    copies, views = setup(device)
    paged, slots = list(range(0, 48, 3)), list(range(16))
    bad = []
    settle(device)
    with compute_stream():
        for i in range(ITERATIONS):
            slow_work()
            for key, value in views:  # the forward's cache writes, queued behind the matmuls
                key[paged] = float(i + 1)
                value[paged] = -float(i + 1)
            fence = copies.save(paged, slots)
            fence.wait()
            block = copies.pool[slots]
            if not (bool((block[:, :, 0] == i + 1).all()) and bool((block[:, :, 1] == -(i + 1)).all())):
                bad.append(i)
    assert not bad, f"{len(bad)} of {ITERATIONS} saves copied bytes from before the forward's writes"


def test_load_is_in_before_the_next_kernel(device, compute_stream, slow_work) -> None:
    copies, views = setup(device, blocks_per_buffer=4)
    slots, paged = [5, 6, 7, 8, 20, 2, 30, 31, 40, 12], [1, 9, 17, 25, 33, 41, 49, 57, 3, 11]
    snapshot = torch.empty((LAYERS, len(paged), BLOCK, HEADS, HEAD), dtype=copies.pool.dtype, device=device)
    paged_t = torch.tensor(paged, device=device)
    bad = []
    settle(device)
    with compute_stream():
        for i in range(ITERATIONS):
            settle(device)  # the host writes the pool: nothing in flight reads it
            for j, slot in enumerate(slots):
                copies.pool[slot].fill_(value(i, j))
            for key, _ in views:
                key.fill_(-1.0)
            slow_work()
            fence = copies.load(slots, paged)
            fence.wait_ready()
            for layer, (key, _) in enumerate(views):  # the next layer's attention reading its blocks
                snapshot[layer].copy_(key[paged_t])
            fence.wait()
            want = torch.tensor([value(i, j) for j in range(len(slots))], dtype=snapshot.dtype, device=device)
            if not torch.equal(snapshot[..., 0, 0, 0], want.expand(LAYERS, -1)):
                bad.append(i)
    settle(device)
    assert not bad, f"{len(bad)} of {ITERATIONS} loads were read before they landed"


def test_staging_buffers_are_reused_only_when_free(device, compute_stream) -> None:
    """One block per buffer: every chunk reuses the buffer of two chunks back."""
    copies, views = setup(device, layout="LBHNC", blocks_per_buffer=1)
    n = 24
    g = torch.Generator().manual_seed(0)
    bad = []
    settle(device)
    with compute_stream():
        for i in range(max(2, ITERATIONS // 10)):
            source = torch.randn((n, *copies.pool.shape[1:]), generator=g).to(copies.pool.dtype)
            settle(device)
            copies.pool[:n].copy_(source)
            order = torch.randperm(NUM_PAGED, generator=g)[:n].tolist()
            load = copies.load(list(range(n)), order)  # pool -> caches
            save = copies.save(order, list(range(n, 2 * n)))  # caches -> other pool slots, same buffers
            load.wait()
            save.wait()
            if not torch.equal(copies.pool[n : 2 * n], source):
                bad.append(i)
    assert not bad, f"{len(bad)} round trips came back with another chunk's bytes"


def test_fence_done_means_the_pool_side_finished(device, compute_stream, slow_work) -> None:
    copies, views = setup(device, blocks_per_buffer=16)
    paged, slots = list(range(32)), list(range(32))
    settle(device)
    with compute_stream():
        for i in range(max(2, ITERATIONS // 10)):
            slow_work()
            for key, value in views:
                key[paged] = float(i + 2)
                value[paged] = float(i + 2)
            fence = copies.save(paged, slots)
            while not fence.done():  # what the worker polls before publishing
                pass
            assert bool((copies.pool[slots] == i + 2).all()), f"iteration {i}: done() before the D2H finished"
