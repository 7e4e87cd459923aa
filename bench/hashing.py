"""The cost of token fingerprints: keying a prompt's blocks with and without them.

    python bench/hashing.py [--tokens 4096] [--block-size 16] [--repeats 5] [--json PATH]

Rows, microseconds per block (lower is better), each beside a same-run baseline:

- ``block_keys_for`` (block hashes + token fingerprints, what a connector computes now) vs
  ``block_hashes_for`` (block hashes alone, what it computed before fingerprints), for SHA-256
  and xxh3-128 block hashes (the fingerprint is SHA-256 either way).
- The per-block extra digest alone: ``fingerprint_block_tokens`` of one block vs
  ``hash_block_tokens`` of the same block.

A prompt of ``--tokens`` random token ids; ratios above 1 are the extra cost.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from bench.common import Case, Row, arg_parser, measure, print_table, write_outputs  # noqa: E402
from kvtier.hashing import (  # noqa: E402
    KeyContext,
    block_hashes_for,
    block_keys_for,
    fingerprint_block_tokens,
    hash_block_tokens,
)

NAME = "hashing"
NAMESPACE = KeyContext(model_id="kvtier-bench").namespace()


def per_block_us(case: Case, baseline: Case, num_blocks: int, repeats: int, stat: str) -> tuple[float, float]:
    value, base = measure([case, baseline], repeats)
    return value.seconds(stat) / num_blocks * 1e6, base.seconds(stat) / num_blocks * 1e6


def main(argv: list[str] | None = None) -> list[Row]:
    parser = arg_parser(__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="prompt length in tokens")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    args = parser.parse_args(argv)
    tokens = np.random.default_rng(0).integers(0, 150_000, args.tokens).tolist()
    num_blocks = args.tokens // args.block_size
    rows: list[Row] = []
    for hash_name in ("sha256", "xxh3_128"):
        keys = Case(lambda h=hash_name: block_keys_for(tokens, NAMESPACE, args.block_size, h))
        hashes = Case(lambda h=hash_name: block_hashes_for(tokens, NAMESPACE, args.block_size, h))
        value, base = per_block_us(keys, hashes, num_blocks, args.repeats, args.stat)
        rows.append(Row(f"{hash_name}: block_keys_for (hash + fingerprint)", value, "us/block", base,
                        "block_hashes_for (hash alone)"))
    block = tokens[: args.block_size]
    reps = 2000
    digest = Case(lambda: [fingerprint_block_tokens(NAMESPACE, block) for _ in range(reps)])
    hashed = Case(lambda: [hash_block_tokens(NAMESPACE, block) for _ in range(reps)])
    value, base = per_block_us(digest, hashed, reps, args.repeats, args.stat)
    rows.append(Row("the extra digest: fingerprint_block_tokens", value, "us/block", base,
                    "hash_block_tokens (sha256)"))
    print_table(
        f"kvtier hashing: {args.tokens} tokens, {num_blocks} blocks of {args.block_size}; "
        f"{args.stat} of {args.repeats} after one warm-up",
        rows, "ratio = cost with fingerprints / cost without (the extra work per block, beside it)",
    )
    write_outputs(args, NAME, rows)
    return rows


if __name__ == "__main__":
    main()
