"""Tiny block-copy cases shared by the kernel tests: specs, poisoned outputs, odd strides.

Inputs are random (``torch.randn``), outputs are filled with ``SENTINEL`` first, so a copy that
skips an element or writes outside its region shows up as a mismatch or a lost sentinel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SENTINEL = 1e4  # exact in fp32, fp16 and bf16; randn never produces it
BLOCK_IDS = [5, 0, 3]  # unordered, distinct, pool of 7 blocks
PAGED_BLOCK_IDS = [2, 4, 0]  # unordered, distinct, paged caches of 6 blocks
NUM_POOL_BLOCKS = 7
NUM_PAGED_BLOCKS = 6
HEAD_DIM_PAD = 8  # extra columns of the backing tensors of strided views


@dataclass(frozen=True)
class Spec:
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    strided_pool: bool = False  # pool is a view of a wider tensor (head_dim + HEAD_DIM_PAD)
    num_layers: int = 2

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        strided = "-strided" if self.strided_pool else ""
        return f"bs{self.block_size}-h{self.num_kv_heads}-d{self.head_dim}-{dtype}{strided}"

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)


# Each block_size, head_dim (80 is not a power of two: masked tiles), head count and dtype
# appears several times; most (block_size, head_dim) pairs appear once.
SPECS = [
    Spec(1, 1, 64, torch.float32),
    Spec(1, 3, 80, torch.float16, strided_pool=True),
    Spec(16, 1, 80, torch.bfloat16),
    Spec(16, 3, 128, torch.float32, strided_pool=True),
    Spec(16, 3, 64, torch.float16),
    Spec(32, 3, 80, torch.float32),
    Spec(32, 1, 128, torch.float16, strided_pool=True),
    Spec(32, 3, 128, torch.bfloat16),
]
SMALL_SPECS = [SPECS[1], SPECS[2], SPECS[4]]


def _filled(shape: tuple[int, ...], dtype: torch.dtype, device: str, poisoned: bool) -> torch.Tensor:
    if poisoned:
        return torch.full(shape, SENTINEL, dtype=dtype, device=device)
    return torch.randn(shape, device=device).to(dtype)


def ids(values: list[int], device: str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def make_pool(spec: Spec, device: str, *, poisoned: bool = False) -> torch.Tensor:
    """``[NUM_POOL_BLOCKS, *block_shape]``: random, or all ``SENTINEL`` when ``poisoned``."""
    shape = (NUM_POOL_BLOCKS, *spec.block_shape)
    if not spec.strided_pool:
        return _filled(shape, spec.dtype, device, poisoned)
    wide = _filled((*shape[:-1], spec.head_dim + HEAD_DIM_PAD), spec.dtype, device, poisoned)
    return wide[..., : spec.head_dim]


def make_hf_caches(
    spec: Spec, seq_len: int, device: str, *, poisoned: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer ``[1, num_kv_heads, seq_len, head_dim]`` K and V caches, all non-contiguous.

    K is a slice of a ``[1, H, seq_len + 3, head_dim + pad]`` tensor starting at token 1; V is
    the transposed view of a ``[1, seq_len, H, head_dim]`` tensor (the other stride group).
    Returns ``(keys, values, backing)`` where ``backing`` holds every storage written to.
    """
    keys, values, backing = [], [], []
    for _ in range(spec.num_layers):
        key_shape = (1, spec.num_kv_heads, seq_len + 3, spec.head_dim + HEAD_DIM_PAD)
        key_base = _filled(key_shape, spec.dtype, device, poisoned)
        value_base = _filled((1, seq_len, spec.num_kv_heads, spec.head_dim), spec.dtype, device, poisoned)
        keys.append(key_base[:, :, 1 : seq_len + 1, : spec.head_dim])
        values.append(value_base.transpose(1, 2))
        backing += [key_base, value_base]
    return keys, values, backing


def make_paged_caches(
    spec: Spec, device: str, *, poisoned: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Per-layer K and V ``[NUM_PAGED_BLOCKS, block_size, H, head_dim]`` block views of the
    engine layouts kvtier meets, so the layers form several stride groups:

    - even layers: vLLM's FlashAttention cache ``[2, num_blocks, block_size, H, D]`` (K, V =
      ``cache[0]``, ``cache[1]``);
    - odd layers: K from a FlashInfer-style ``[num_blocks, 2, block_size, H, D]`` cache, cut from
      a bigger tensor (blocks 1.., head_dim padded); V from an ``HND`` cache
      ``[num_blocks, H, block_size, D]`` seen through ``transpose(1, 2)``.

    Returns ``(keys, values, backing)`` where ``backing`` holds every storage written to.
    """
    nb, bs, heads, d = NUM_PAGED_BLOCKS, spec.block_size, spec.num_kv_heads, spec.head_dim
    keys, values, backing = [], [], []
    for layer in range(spec.num_layers):
        if layer % 2 == 0:
            flash = _filled((2, nb, bs, heads, d), spec.dtype, device, poisoned)
            keys.append(flash[0])
            values.append(flash[1])
            backing.append(flash)
        else:
            flashinfer = _filled((nb + 2, 2, bs, heads, d + HEAD_DIM_PAD), spec.dtype, device, poisoned)
            hnd = _filled((nb, heads, bs, d), spec.dtype, device, poisoned)
            keys.append(flashinfer[1 : nb + 1, 0, ..., :d])
            values.append(hnd.transpose(1, 2))
            backing += [flashinfer, hnd]
    return keys, values, backing


def make_staging(spec: Spec, n: int, device: str, *, poisoned: bool) -> torch.Tensor:
    """Contiguous ``[n, *block_shape]``."""
    return _filled((n, *spec.block_shape), spec.dtype, device, poisoned)


def assert_same(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    """Bit-exact equality of two lists of tensors (copies must not round)."""
    assert len(actual) == len(expected)
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a.shape == e.shape and a.dtype == e.dtype, f"tensor {i}: {a.shape}/{a.dtype} vs {e.shape}/{e.dtype}"
        assert torch.equal(a, e), f"tensor {i} differs at {(a != e).nonzero()[:5].tolist()}"


def num_written(tensors: list[torch.Tensor]) -> int:
    """Elements no longer holding ``SENTINEL``."""
    return sum(int((t != SENTINEL).sum()) for t in tensors)
