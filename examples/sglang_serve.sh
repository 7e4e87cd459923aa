#!/usr/bin/env bash
# Two SGLang engines sharing one kvtier cache: a `kvtier serve` daemon, then an SGLang server
# whose HiCache L3 is kvtier (its DISK under $KVTIER_DATA_DIR, the daemon behind it).
#
#   MODEL=meta-llama/Llama-3.1-8B-Instruct PORT=30000 examples/sglang_serve.sh
#
# Start it again with another PORT (and another KVTIER_DATA_DIR, or on another machine with
# KVTIER_REMOTE_URL pointing at the daemon): the second engine hits what the first computed.
# Needs a machine SGLang runs on (CUDA); kvtier on PYTHONPATH or installed in SGLang's env.
set -euo pipefail
MODEL=${MODEL:?set MODEL to a model path or id}
PORT=${PORT:-30000}
export KVTIER_DATA_DIR=${KVTIER_DATA_DIR:-$PWD/.data/sglang-$PORT}
export KVTIER_REMOTE_URL=${KVTIER_REMOTE_URL:-http://127.0.0.1:8765}

if ! curl -sf "$KVTIER_REMOTE_URL/healthz" >/dev/null; then
    kvtier serve --data-dir "${KVTIER_DAEMON_DIR:-$PWD/.data/daemon}" --cpu-bytes 4GiB --disk-bytes 100GiB --durable &
    for _ in $(seq 50); do curl -sf "$KVTIER_REMOTE_URL/healthz" >/dev/null && break; sleep 0.2; done
fi

exec python -m sglang.launch_server --model-path "$MODEL" --port "$PORT" \
    --page-size 64 --enable-hierarchical-cache --hicache-ratio 2 \
    --hicache-mem-layout page_first --hicache-io-backend kernel \
    --hicache-storage-backend dynamic \
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier", "module_path": "kvtier.connectors.sglang", "class_name": "KVTierStorage", "interface_v1": 1, "disk_bytes": "100GiB"}'
