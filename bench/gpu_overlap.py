"""``bench/gpu.py`` step ``overlap``: how much of a per-layer load hides behind the model's compute.

A load of ``overlap_blocks`` Llama-3-8B blocks (2 MiB, 32 layers) held only in the CPU slab:
``store.prefetch`` starts the CPU->GPU copies with one event per layer, then, per layer,
``handle.wait_layer(l)`` (the compute stream waits for that layer's event, no host sync), the
Triton gather of layer ``l`` into a per-layer cache (``gather_blocks_to_layers``), and that
layer's compute: two matmuls with the FLOPs of one Llama-3-8B decoder layer on ``tokens`` new
tokens (2 x 218 M parameters x tokens). Three cases, interleaved (``bench.common.measure``):

- compute alone (32 layers of matmuls);
- load alone (prefetch, per-layer waits and gathers, no compute);
- load overlapped with compute (the per-layer loop above).

``hidden = (load + compute - overlapped) / load``: 100% when the load costs nothing on top of
the compute, 0% when they ran one after the other. The load can only hide where a layer's
compute outlasts its copy, so the step runs at two suffix lengths (the issue's target, >= 90%
hidden, is read at the longer one).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import torch

from bench.common import Case, Row, measure
from bench.tiers import NAMESPACE, SPEC, make_blocks
from kvtier.hashing import block_hashes_for

if TYPE_CHECKING:
    from bench.gpu import Run

log = logging.getLogger("bench.gpu")

LAYER_PARAMS = 218_103_808  # Llama-3-8B decoder layer: 4096 x (4096 + 2 x 1024 + 4096) + 3 x 4096 x 14336
HIDDEN = 4096


def layer_compute(tokens: int, device: torch.device, dtype: torch.dtype, hidden: int = HIDDEN,
                  params: int = LAYER_PARAMS) -> Callable[[], None]:
    """One decoder layer's matmul FLOPs on ``tokens`` tokens: ``x @ A @ B`` with
    ``A [hidden, params / (2 hidden)]``, ``B`` its transpose's shape (random, never zeros)."""
    inner = params // (2 * hidden)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(hidden, inner, generator=g).to(dtype).to(device) / hidden**0.5
    b = torch.randn(inner, hidden, generator=g).to(dtype).to(device) / inner**0.5
    x = torch.randn(tokens, hidden, generator=g).to(dtype).to(device)

    def run() -> None:
        torch.mm(torch.mm(x, a), b)

    return run


def step_overlap(run: Run) -> list[Row]:
    from bench.gpu import evict_gpu, kernels_mode
    from kvtier import kernels

    p = run.plan
    n, num_layers = p.overlap_blocks, SPEC.num_layers
    store = run.store(SPEC, gpu_blocks=n, cpu_blocks=n, tag="overlap")
    rows: list[Row] = []
    try:
        hashes = block_hashes_for(list(range(n * SPEC.block_size)), NAMESPACE, SPEC.block_size)
        blocks = make_blocks(n, run.device)
        assert store.store(hashes, blocks) == n, "the GPU pool did not take every block"
        del blocks
        evict_gpu(store)  # every block now only in the CPU slab

        def load(compute: Callable[[], None] | None) -> Callable[[], None]:
            def go() -> None:
                handle = store.prefetch(hashes)
                ids = torch.tensor(handle.block_ids, dtype=torch.int64, device=run.device)
                with kernels_mode("triton" if run.cuda else "torch"):
                    for layer in range(num_layers):
                        handle.wait_layer(layer)
                        kernels.gather_blocks_to_layers(store.top.tensor[:, layer : layer + 1], ids, check_ids=False)
                        if compute is not None:
                            compute()
                result = handle.wait()
                assert len(result.block_ids) == n, "the prefetch came back short"
                result.lease.release()
            return go

        evict = lambda: evict_gpu(store)  # noqa: E731
        for tokens in p.overlap_tokens:
            if run.out_of_time():
                run.note(f"overlap at {tokens} tokens skipped: past the {run.budget_s:.0f} s budget")
                continue
            one_layer = layer_compute(tokens, run.device, SPEC.dtype, p.overlap_hidden, p.overlap_layer_params)

            def compute_all(one_layer: Callable[[], None] = one_layer) -> None:
                for _ in range(num_layers):
                    one_layer()

            t_compute, t_load, t_both = measure(
                [Case(compute_all), Case(load(None), evict), Case(load(one_layer), evict)], p.repeats, sync=run.sync()
            )
            compute_ms, load_ms, both_ms = (t.median_s * 1e3 for t in (t_compute, t_load, t_both))
            hidden = 100.0 * max(0.0, min(1.0, (load_ms + compute_ms - both_ms) / load_ms))
            label = f"overlap: {n} blocks ({n * SPEC.block_size} tokens) under {tokens}-token layers"
            log.info("%s: load %.2f ms, compute %.2f ms, overlapped %.2f ms, %.0f%% of the load hidden",
                     label, load_ms, compute_ms, both_ms, hidden)
            rows += [
                Row(f"{label}: load + compute, per-layer waits", both_ms, "ms", load_ms + compute_ms, "load, then compute"),
                Row(f"{label}: load alone (prefetch, waits, gathers)", load_ms, "ms", compute_ms, "compute alone"),
                Row(f"overlap: share of load time hidden, {tokens}-token layers", hidden, "%"),
            ]
        return rows
    finally:
        store.close()
