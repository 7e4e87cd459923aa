"""Block copies between a kvtier pool and model caches: Triton on CUDA, plain torch elsewhere.

Two engine layouts, one copy each way:

- *contiguous* (HF transformers' ``DynamicCache``): per layer a K and a V tensor
  ``[1, num_kv_heads, seq_len, head_dim]``; a request's blocks sit at consecutive tokens from
  ``start_token``: :func:`gather_blocks_to_contiguous` / :func:`scatter_contiguous_to_blocks`
  (and :func:`gather_blocks_to_layers`, which allocates the caches first).
- *paged* (vLLM, transformers' paged cache): per layer a K and a V tensor
  ``[num_paged_blocks, block_size, num_kv_heads, head_dim]``, any strides; blocks sit in slots
  named by ``paged_block_ids``: :func:`gather_blocks_to_paged` / :func:`scatter_paged_to_blocks`.
  Another engine's paged layout is a strided view of its cache in that shape (vLLM's
  ``[2, num_blocks, block_size, H, D]`` FlashAttention cache is ``cache[0]``, ``cache[1]``;
  FlashInfer's ``[num_blocks, 2, block_size, H, D]`` is ``cache[:, 0]``, ``cache[:, 1]``; an
  ``HND`` cache is ``cache[0].transpose(1, 2)``), never a new kernel.

Both reduce to one copy between the pool and per-layer *block views*
``[num_blocks, block_size, num_kv_heads, head_dim]`` (:func:`.reference.gather`,
:func:`.reference.scatter` and their Triton twins in :mod:`.triton_kv`); :func:`pack_blocks` /
:func:`unpack_blocks` copy whole blocks to and from one staging buffer (one large DMA).

The public functions validate their inputs (``ValueError``, "expected ..., got ..."), then run
either :mod:`.triton_kv` or :mod:`.reference`, chosen per call by :func:`use_triton` on the pool
(triton is imported on the first call that needs it, never by ``import kvtier.kernels``):

- ``KVTIER_KERNELS=auto`` (default): Triton for CUDA tensors when triton imports, else torch.
- ``KVTIER_KERNELS=torch``: always the torch reference.
- ``KVTIER_KERNELS=triton``: Triton wherever it can run: CUDA tensors, or CPU tensors when the
  kernels were decorated under ``TRITON_INTERPRET=1`` (how the tests exercise them); other
  tensors still use torch. Raises ``RuntimeError`` if triton cannot be imported.

The pool is ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` (``2`` = K, V).
Block ids are 1-D int64 tensors on the pool's device; every id must be in range, and the ids
naming a copy's *destination* must be distinct. Those two checks read the ids back to the host
(a device sync); pass ``check_ids=False`` to skip them on a hot path whose ids are known good.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from types import ModuleType
from typing import Literal

import torch

from . import reference, validation
from .validation import check_contiguous, check_paged, check_pool, check_staging

__all__ = [
    "gather_blocks_to_contiguous",
    "gather_blocks_to_layers",
    "gather_blocks_to_paged",
    "kernel_mode",
    "pack_blocks",
    "scatter_contiguous_to_blocks",
    "scatter_paged_to_blocks",
    "unpack_blocks",
    "use_triton",
]

_MODES = ("torch", "triton", "auto")
_triton_kv: ModuleType | None = None
_triton_import_error: Exception | None = None


def kernel_mode() -> Literal["torch", "triton", "auto"]:
    """``KVTIER_KERNELS`` (read on every call): ``"torch"``, ``"triton"`` or ``"auto"`` (default).

    Raises:
        ValueError: the variable holds anything else.
    """
    mode = os.environ.get("KVTIER_KERNELS", "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise ValueError(f"expected KVTIER_KERNELS in {_MODES}, got {mode!r}")
    return mode  # type: ignore[return-value]


def _load_triton() -> ModuleType | None:
    """The :mod:`.triton_kv` module, imported on first use; ``None`` if triton cannot be imported."""
    global _triton_kv, _triton_import_error
    if _triton_kv is None and _triton_import_error is None:
        try:
            from . import triton_kv

            _triton_kv = triton_kv
        except Exception as exc:  # ImportError, or a triton build without a usable backend
            _triton_import_error = exc
    return _triton_kv


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether the copies of ``tensor`` (the pool) run the Triton kernels; see the module docstring.

    Raises:
        ValueError: ``KVTIER_KERNELS`` is not one of torch, triton, auto.
        RuntimeError: ``KVTIER_KERNELS=triton`` but triton cannot be imported.
    """
    mode = kernel_mode()
    if mode == "torch" or (mode == "auto" and not tensor.is_cuda):
        return False
    triton_kv = _load_triton()
    if triton_kv is None:
        if mode == "triton":
            raise RuntimeError(f"KVTIER_KERNELS=triton but triton cannot be imported: {_triton_import_error!r}")
        return False
    if triton_kv.INTERPRETED:  # the interpreter reads host memory only (see triton_kv)
        return mode == "triton" and tensor.device.type == "cpu"
    return tensor.is_cuda


def _impl(pool: torch.Tensor) -> ModuleType:
    return _triton_kv if use_triton(pool) else reference  # type: ignore[return-value]


def _contiguous_views(
    caches: Sequence[torch.Tensor], start_token: int, num_blocks: int, block_size: int
) -> list[torch.Tensor]:
    """Block views ``[num_blocks, block_size, num_kv_heads, head_dim]`` of HF caches
    ``[1, num_kv_heads, seq_len, head_dim]`` from ``start_token`` on (views, no copy)."""
    end = start_token + num_blocks * block_size
    split = (num_blocks, block_size)
    return [cache[0, :, start_token:end].unflatten(1, split).permute(1, 2, 0, 3) for cache in caches]


def gather_blocks_to_contiguous(
    pool: torch.Tensor,
    block_ids: torch.Tensor,
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    start_token: int = 0,
    *,
    check_ids: bool = True,
) -> None:
    """Copy blocks, in order, into per-layer HF caches at consecutive token positions.

    Block ``block_ids[i]`` lands at tokens ``start_token + i * block_size`` .. ``+ block_size``
    of ``key_caches[l]`` / ``value_caches[l]`` for every layer ``l``; other tokens are untouched.

    Args:
        pool: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``, any float dtype.
        block_ids: ``[n]`` int64 on the pool's device, pool blocks to read (repeats allowed).
        key_caches: ``num_layers`` tensors ``[1, num_kv_heads, seq_len, head_dim]`` of the pool's
            dtype and device, ``seq_len >= start_token + n * block_size``, any strides; written.
        value_caches: like ``key_caches``, for V.
        start_token: first token position written, ``>= 0``.
        check_ids: check every id is in range (one device sync).

    Raises:
        ValueError: a shape, dtype, device, ``start_token`` or (with ``check_ids``) id is wrong.
    """
    check_contiguous(pool, block_ids, key_caches, value_caches, start_token, to_pool=False, check_values=check_ids)
    n, block_size = block_ids.numel(), pool.shape[3]
    keys = _contiguous_views(key_caches, start_token, n, block_size)
    values = _contiguous_views(value_caches, start_token, n, block_size)
    _impl(pool).gather(pool, block_ids, keys, values, None)


def gather_blocks_to_layers(
    pool: torch.Tensor, block_ids: torch.Tensor, *, check_ids: bool = True
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Copy blocks, in order, into newly allocated per-layer HF caches.

    Args:
        pool: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``, any float dtype.
        block_ids: ``[n]`` int64 on the pool's device, pool blocks to read (repeats allowed).
        check_ids: check every id is in range (one device sync).

    Returns:
        ``(keys, values)``: ``num_layers`` contiguous tensors each
        ``[1, num_kv_heads, n * block_size, head_dim]``, of the pool's dtype and device.

    Raises:
        ValueError: ``pool`` or ``block_ids`` is malformed, or (with ``check_ids``) an id is out of range.
    """
    check_pool(pool)
    validation.check_ids("block_ids", block_ids, pool.device)
    _, num_layers, _, block_size, num_kv_heads, head_dim = pool.shape
    shape = (1, num_kv_heads, block_ids.numel() * block_size, head_dim)
    keys = [pool.new_empty(shape) for _ in range(num_layers)]
    values = [pool.new_empty(shape) for _ in range(num_layers)]
    gather_blocks_to_contiguous(pool, block_ids, keys, values, check_ids=check_ids)
    return keys, values


def scatter_contiguous_to_blocks(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    pool: torch.Tensor,
    block_ids: torch.Tensor,
    start_token: int = 0,
    *,
    check_ids: bool = True,
) -> None:
    """Copy consecutive tokens of per-layer HF caches into pool blocks (inverse of the gather).

    Tokens ``start_token + i * block_size`` .. ``+ block_size`` of every layer land in
    ``pool[block_ids[i]]``; other pool blocks are untouched.

    Args:
        key_caches: ``num_layers`` tensors ``[1, num_kv_heads, seq_len, head_dim]`` of the pool's
            dtype and device, ``seq_len >= start_token + n * block_size``, any strides.
        value_caches: like ``key_caches``, for V.
        pool: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``; written.
        block_ids: ``[n]`` int64 on the pool's device, distinct pool blocks to write.
        start_token: first token position read, ``>= 0``.
        check_ids: check ids are in range and distinct (one device sync).

    Raises:
        ValueError: a shape, dtype, device, ``start_token`` or (with ``check_ids``) id is wrong.
    """
    check_contiguous(pool, block_ids, key_caches, value_caches, start_token, to_pool=True, check_values=check_ids)
    n, block_size = block_ids.numel(), pool.shape[3]
    keys = _contiguous_views(key_caches, start_token, n, block_size)
    values = _contiguous_views(value_caches, start_token, n, block_size)
    _impl(pool).scatter(keys, values, None, pool, block_ids)


def gather_blocks_to_paged(
    pool: torch.Tensor,
    block_ids: torch.Tensor,
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    paged_block_ids: torch.Tensor,
    *,
    check_ids: bool = True,
) -> None:
    """Copy ``pool[block_ids[i], l]`` into block ``paged_block_ids[i]`` of ``key_caches[l]`` and
    ``value_caches[l]`` for every layer ``l``.

    Args:
        pool: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``, any float dtype.
        block_ids: ``[n]`` int64 on the pool's device, pool blocks to read (repeats allowed).
        key_caches: ``num_layers`` tensors ``[num_paged_blocks, block_size, num_kv_heads,
            head_dim]`` of the pool's dtype and device, any strides (a view of the engine's
            cache, see the module docstring); written.
        value_caches: like ``key_caches``, for V.
        paged_block_ids: ``[n]`` int64 on the pool's device, distinct paged slots to write.
        check_ids: check ids are in range and destinations distinct (one device sync per id tensor).

    Raises:
        ValueError: a shape, dtype, device or (with ``check_ids``) id is wrong.
    """
    check_paged(pool, block_ids, key_caches, value_caches, paged_block_ids, to_pool=False, check_values=check_ids)
    _impl(pool).gather(pool, block_ids, key_caches, value_caches, paged_block_ids)


def scatter_paged_to_blocks(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    paged_block_ids: torch.Tensor,
    pool: torch.Tensor,
    block_ids: torch.Tensor,
    *,
    check_ids: bool = True,
) -> None:
    """Copy block ``paged_block_ids[i]`` of ``key_caches[l]`` and ``value_caches[l]`` into
    ``pool[block_ids[i], l]`` for every layer ``l``.

    Args:
        key_caches: ``num_layers`` tensors ``[num_paged_blocks, block_size, num_kv_heads,
            head_dim]`` of the pool's dtype and device, any strides.
        value_caches: like ``key_caches``, for V.
        paged_block_ids: ``[n]`` int64 on the pool's device, paged slots to read (repeats allowed).
        pool: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``; written.
        block_ids: ``[n]`` int64 on the pool's device, distinct pool blocks to write.
        check_ids: check ids are in range and destinations distinct (one device sync per id tensor).

    Raises:
        ValueError: a shape, dtype, device or (with ``check_ids``) id is wrong.
    """
    check_paged(pool, block_ids, key_caches, value_caches, paged_block_ids, to_pool=True, check_values=check_ids)
    _impl(pool).scatter(key_caches, value_caches, paged_block_ids, pool, block_ids)


def pack_blocks(pool: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor, *, check_ids: bool = True) -> None:
    """Copy ``pool[block_ids[i]]`` into ``staging[i]`` (one buffer, then one large DMA).

    Args:
        pool: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``, any float dtype.
        block_ids: ``[n]`` int64 on the pool's device, pool blocks to read (repeats allowed).
        staging: ``[n, num_layers, 2, block_size, num_kv_heads, head_dim]`` of the pool's dtype and
            device, usually contiguous (any strides work); written.
        check_ids: check every id is in range (one device sync).

    Raises:
        ValueError: a shape, dtype, device or (with ``check_ids``) id is wrong.
    """
    check_staging(pool, block_ids, staging, to_pool=False, check_values=check_ids)
    _impl(pool).pack_blocks(pool, block_ids, staging)


def unpack_blocks(
    staging: torch.Tensor, pool: torch.Tensor, block_ids: torch.Tensor, *, check_ids: bool = True
) -> None:
    """Copy ``staging[i]`` into ``pool[block_ids[i]]``.

    Args:
        staging: ``[n, num_layers, 2, block_size, num_kv_heads, head_dim]`` of the pool's dtype
            and device, any strides.
        pool: ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``; written.
        block_ids: ``[n]`` int64 on the pool's device, distinct pool blocks to write.
        check_ids: check ids are in range and distinct (one device sync).

    Raises:
        ValueError: a shape, dtype, device or (with ``check_ids``) id is wrong.
    """
    check_staging(pool, block_ids, staging, to_pool=True, check_values=check_ids)
    _impl(pool).unpack_blocks(staging, pool, block_ids)
