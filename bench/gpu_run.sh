#!/usr/bin/env bash
# kvtier's GPU run in one go, on a CUDA machine with nothing to download (this project's device
# image has torch 2.11, triton 3.6, transformers 5.17, msgpack, aiohttp, xxhash, pytest, ...;
# lmdb, kvtier's DISK tier, travels as a wheel in .whl/; vLLM is not there and cannot travel:
# bench/results/README.md says why and how to carry lmdb):
#
#   bash bench/gpu_run.sh [--dry-run] [bench/gpu.py args, e.g. --quick]
#
# Installs the carried wheels (.whl/*.whl) into $KVTIER_WHEEL_SITE (default /tmp/site), writes
# the environment to $OUT/env.txt, then runs bench/gpu.py: GPU tests (pytest -m gpu), H2D/D2H
# vs raw pinned copy, Triton gather vs torch index copy and device copy, per-layer overlap, HF
# TTFT at 8k and 32k cached tokens on Llama-3.1-8B's architecture in bf16, vLLM TTFT where
# vLLM imports (else skipped with a note). It prints its table last and writes env.txt,
# gpu.json, summary.md, gpu.log, pytest.log, pytest.xml (and vllm.log) into $OUT (default
# ./gpu-results): 7 files at most. No step starts after KVTIER_GPU_BUDGET_S seconds (default
# 400); on an H200 the run should take about 5 minutes (an estimate: never run on one yet).
#
# --dry-run: the same steps on the CPU with tiny sizes (bench/gpu.py --device cpu: the Triton
# interpreter, tests/gpu on the CPU): checks that this script and every step run, not the GPU.
# Exit code: bench/gpu.py's (1 when a test or a step failed), 2 without CUDA (unless --dry-run).
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE_ARGS=()
if [[ "${1:-}" == "--dry-run" ]]; then
    shift
    DEVICE_ARGS=(--device cpu)
fi
export OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
PYTHON=${PYTHON:-python3}
WHEELS_NOTE="no carried wheels (.whl/ empty or absent)"
if compgen -G ".whl/*.whl" >/dev/null; then
    SITE=${KVTIER_WHEEL_SITE:-/tmp/site}
    # A wheel for another Python (the dry run's host) is refused by pip: say so and go on; what
    # needs it (the DISK tier: its tests skip, the vllm step) reports itself.
    if "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        .whl/*.whl >"$OUT/wheels.txt" 2>&1; then
        export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
        WHEELS_NOTE="installed into $SITE: $(cd .whl && echo *.whl)"
    else
        WHEELS_NOTE="NOT installed ($(tail -1 "$OUT/wheels.txt"))"
        echo "gpu_run.sh: installing the carried wheels in .whl/ failed; going on without them" >&2
    fi
    rm -f "$OUT/wheels.txt"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
    date -u
    echo "carried wheels: $WHEELS_NOTE"
    if command -v nvidia-smi >/dev/null; then nvidia-smi; else echo "nvidia-smi: not here"; fi
    "$PYTHON" - <<'EOF'
import importlib, importlib.metadata, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("torch", "triton", "transformers", "lmdb", "msgpack", "xxhash", "aiohttp", "pytest", "vllm", "kvtier"):
    try:
        module = importlib.import_module(name)
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            version = getattr(module, "__version__", "?")
        print(name, version, getattr(module, "__file__", ""))
    except Exception as exc:  # noqa: BLE001
        print(name, "not importable:", type(exc).__name__, exc)
import torch
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
else:
    print("device: no CUDA")
EOF
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
exec "$PYTHON" bench/gpu.py --out "$OUT" --budget-s "${KVTIER_GPU_BUDGET_S:-400}" "${DEVICE_ARGS[@]}" "$@"
