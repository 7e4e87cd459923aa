"""One engine process of tests/sglang/test_shared.py: builds SGLang's storage config, a host
pool and the backend the way SGLang does, stores or loads 6 pages of deterministic data, and
prints one JSON line.

    python -m tests.sglang.worker store|load DATA_DIR [REMOTE_URL|-] [MODEL_NAME]
"""

from __future__ import annotations

import json
import sys

import torch

from tests.sglang.conftest import PAGE_SIZE, fill_random, new_host_pool, page_keys, pages, storage_config

NUM_PAGES = 6


def main(argv: list[str]) -> dict:
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    op, data_dir = argv[0], argv[1]
    remote = argv[2] if len(argv) > 2 and argv[2] != "-" else None
    model = argv[3] if len(argv) > 3 else "org/model"
    host = new_host_pool()
    config = storage_config(data_dir, model_name=model, **({"remote_url": remote} if remote else {}))
    backend = StorageBackendFactory.create_backend("dynamic", config, host)
    backend.register_mem_pool_host(host)
    keys = page_keys(NUM_PAGES)
    src = host.alloc(NUM_PAGES * PAGE_SIZE)
    fill_random(host, src, seed=11)  # the same bytes in every process
    try:
        if op == "store":
            return {"stored": sum(backend.batch_set_v1(keys, src))}
        dst = host.alloc(NUM_PAGES * PAGE_SIZE)
        hits = backend.batch_exists(keys)
        read = sum(backend.batch_get_v1(keys, dst))
        equal = all(torch.equal(a, b) for a, b in zip(pages(host, src)[:read], pages(host, dst)[:read]))
        loaded = {str(medium): n for medium, n in backend.store.stats.loaded_blocks.items()}
        return {"hits": hits, "read": read, "equal": equal, "loaded": loaded}
    finally:
        backend.close()  # flushes, and waits for the background puts to REMOTE


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
