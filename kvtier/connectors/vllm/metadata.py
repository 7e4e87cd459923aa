"""What the scheduler-side connector tells the workers each step (pickled by vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class LoadSpec:
    """Copy a request's matched blocks from the worker's CPU pool into vLLM's paged cache.

    Attributes:
        req_id: the request; the worker holds its matched blocks under this id.
        block_ids: vLLM block ids to fill, in chain order (``[num_blocks]``).
    """

    req_id: str
    block_ids: list[int]


@dataclass
class SaveSpec:
    """Store blocks whose K/V this step computed.

    Attributes:
        req_id: the request.
        block_hashes: per TP rank (index = rank), the blocks' hashes in chain order.
        block_ids: vLLM block ids holding them (``[num_blocks]``).
        fingerprints: per TP rank, the blocks' token fingerprints (kept with each block).
    """

    req_id: str
    block_hashes: list[list[bytes]]
    block_ids: list[int]
    fingerprints: list[list[bytes]] = field(default_factory=list)


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    """One step: loads (before the forward, layer by layer), saves (layer by layer, published
    in ``wait_for_save``), and requests whose matched blocks the worker may release."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    drops: list[str] = field(default_factory=list)
    prefill_tokens: int = 0
    """Prompt tokens this step computes (the TTFT-saved estimate: kvtier.connectors.ttft)."""
