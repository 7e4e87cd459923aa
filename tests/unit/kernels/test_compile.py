"""The kernel compiles for sm_90 (no GPU needed) and moves 16-byte vectors on both sides.

The interpreter does not type-check like the compiler, and does not show whether loads and
stores are vectorised; this compiles the real kernel to PTX in a subprocess (the test process
runs the interpreter, which patches ``triton.language``). Regression: the alignment hint on the
pointer-table address must sit on the pointer, not on the int64 before ``int_to_ptr``, or the
stores to the per-layer caches are 2-byte scalars.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.slow  # compiles the Triton kernel in a subprocess

_COMPILE = textwrap.dedent(
    """
    import re, sys
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:
        print("SKIP", exc); sys.exit(0)
    from kvtier.kernels import triton_kv

    kernel = triton_kv._copy_block_slabs_kernel
    ints = ["block_size", "num_kv_heads", "head_dim"]
    strides = [n for n in kernel.arg_names if n.startswith("stride_") and not n.endswith("_d")]
    signature = {n: "i32" for n in ints} | {n: "i64" for n in strides}
    signature |= {"block_ids_ptr": "*i64", "other_ids_ptr": "*i64", "slab_table_ptr": "*i64"}
    # as a launch specialises them: unit strides become constants, the rest divisible by 16
    divisible = ["pool_ptr", *(n for n in signature if n.endswith("_ptr") or n in strides or n == "head_dim")]
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    for config in sys.argv[1:]:  # dtype,to_pool,aligned
        dtype, to_pool, aligned = config.split(",")
        constants = dict(stride_pool_d=1, stride_other_d=1, HAS_OTHER_IDS=True, TO_POOL=to_pool == "1",
                         ALIGNED_16=aligned == "1", BLOCK_R=32, BLOCK_D=128)
        sig = signature | {"pool_ptr": "*" + dtype} | {n: "constexpr" for n in constants}
        try:
            compiled = triton.compile(ASTSource(kernel, sig, constants, attrs), target=GPUTarget("cuda", 90, 32))
        except Exception as exc:
            if "ptxas" in str(exc) or "backend" in str(exc).lower():
                print("SKIP", exc); sys.exit(0)
            raise
        print(config, *sorted(set(re.findall(r"(?:ld|st)\\.global[\\w.]*", compiled.asm["ptx"]))))
    """
)

CONFIGS = ["fp16,0,1", "bf16,1,1", "fp16,0,0"]  # dtype, TO_POOL, ALIGNED_16


@pytest.fixture(scope="module")
def instructions() -> dict[str, set[str]]:
    """Global loads/stores in the PTX of each of ``CONFIGS``: one subprocess, ~5 s."""
    root = Path(__file__).resolve().parents[3]
    python_path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": python_path}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    args = [sys.executable, "-c", _COMPILE, *CONFIGS]
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.strip().splitlines()
    if lines and lines[-1].startswith("SKIP"):
        pytest.skip(lines[-1])
    return {line.split()[0]: set(line.split()[1:]) for line in lines}


@pytest.mark.parametrize("config", CONFIGS[:2])
def test_aligned_copies_use_16_byte_vectors(instructions: dict[str, set[str]], config: str) -> None:
    assert {"ld.global.v4.b32", "st.global.v4.b32"} <= instructions[config], instructions[config]


def test_unaligned_table_address_falls_back_to_scalar_access(instructions: dict[str, set[str]]) -> None:
    assert "st.global.b16" in instructions["fp16,0,0"], instructions["fp16,0,0"]
