"""Bytes kvtier stores per token for sliding-window and hybrid models, against the
alternative of storing only the blocks inside each sliding window at the cut (what vLLM's
hybrid KV cache manager keeps on the GPU).

    python bench/kv_bytes.py [--json PATH] [--block-size 16]

No timing: the sizes follow from the block layout. Each model is the published
checkpoint's attention geometry (config.json: layers, K/V heads, head dim, window, layer
pattern), bfloat16, built as a real :class:`kvtier.types.KVSpec`; ``spec.bytes_per_token``
is what every tier stores per token (tests/unit/test_types.py checks a DISK record's payload is
``block_nbytes``).

- kvtier (every position): sliding and chunked layers keep every position's K/V, like full
  layers (docs/architecture.md, "Layer groups"): the same bytes as full attention.
- window-only: at a cut of ``C`` tokens, full (and MLA) layers need all ``C`` positions, a
  sliding layer only the blocks covering its last ``window`` positions (``ceil((window - 1)
  / block_size) + 1`` blocks), a chunked layer those of its current chunk. Reported as bytes
  per token of context; baseline = kvtier's bytes per token, ratio = window-only / kvtier.
- DeepSeek-V3 (MLA): transformers 5.x caches the latent (``kv_lora_rank`` + RoPE dim, one
  head), transformers 4.x cached expanded K (nope + rope dims) and V per head; kvtier stores
  whatever the model's cache holds (its layout is part of the namespace).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import Row, arg_parser, print_table, write_outputs  # noqa: E402
from kvtier.types import KVSpec, LayerGroup  # noqa: E402

CONTEXTS = (4096, 32768)


def _pattern(num_layers: int, full_every: int) -> tuple[list[int], list[int]]:
    """(sliding layers, full layers) when every ``full_every``-th layer is full (1-based)."""
    full = [i for i in range(num_layers) if (i + 1) % full_every == 0]
    return [i for i in range(num_layers) if i not in full], full


def _hybrid(num_layers: int, full_every: int, heads: int, head_dim: int, window: int, kind: str = "sliding"):
    sliding, full = _pattern(num_layers, full_every)
    groups = [LayerGroup(kind, tuple(sliding), heads, head_dim, head_dim, window)]
    if full:
        groups.append(LayerGroup("full", tuple(full), heads, head_dim, head_dim))
    return groups


def models() -> dict[str, list[LayerGroup]]:
    """Attention geometry of published checkpoints (their config.json)."""
    return {
        "Llama-3.1-8B (full)": [LayerGroup("full", tuple(range(32)), 8, 128, 128)],
        "Mistral-7B-v0.1 (sliding 4096)": [LayerGroup("sliding", tuple(range(32)), 8, 128, 128, 4096)],
        "Gemma-2-9B (1:1, window 4096)": _hybrid(42, 2, 8, 256, 4096),
        "Gemma-3-12B (5:1, window 1024)": _hybrid(48, 6, 8, 256, 1024),
        "Gemma-3-27B (5:1, window 1024)": _hybrid(62, 6, 16, 128, 1024),
        "gpt-oss-20b (1:1, window 128)": _hybrid(24, 2, 8, 64, 128),
        "gpt-oss-120b (1:1, window 128)": _hybrid(36, 2, 8, 64, 128),
        "Llama-4-Scout (3:1, chunk 8192)": _hybrid(48, 4, 8, 128, 8192, kind="chunked"),
        "DeepSeek-V3 (MLA latent, transformers 5)": [LayerGroup("mla", tuple(range(61)), 1, 512, 64)],
        "DeepSeek-V3 (MLA expanded, transformers 4)": [LayerGroup("mla", tuple(range(61)), 128, 192, 128)],
    }


def window_only_bytes(spec: KVSpec, context: int) -> int:
    """Bytes of the blocks a cut at ``context`` tokens needs when windowed layers keep only
    the blocks covering their window (or current chunk)."""
    size, itemsize = spec.block_size, spec.dtype.itemsize
    total = 0
    for g in spec.layer_groups:
        tokens = math.ceil(context / size) * size
        if g.window is not None:
            tokens = min(tokens, (math.ceil((g.window - 1) / size) + 1) * size)
        total += len(g.layers) * g.token_numel * itemsize * tokens
    return total


def rows_for(block_size: int) -> list[Row]:
    rows = []
    for name, groups in models().items():
        spec = KVSpec.from_groups(groups, block_size, torch.bfloat16)
        rows.append(Row(f"{name}: kvtier, every position", spec.bytes_per_token / 1024, "KiB/token"))
        if all(g.window is None for g in spec.layer_groups):
            continue
        for context in CONTEXTS:
            windowed = window_only_bytes(spec, context) / context / 1024
            rows.append(Row(f"{name} @{context // 1024}k: window-only", windowed, "KiB/token",
                            spec.bytes_per_token / 1024, "kvtier, every position"))
    return rows


def main() -> None:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    args = parser.parse_args()
    rows = rows_for(args.block_size)
    print_table(f"KV bytes stored per token (bfloat16, block_size {args.block_size})", rows,
                "ratio = window-only / kvtier (kvtier stores every position of sliding layers)")
    write_outputs(args, "kv_bytes", rows)


if __name__ == "__main__":
    main()
