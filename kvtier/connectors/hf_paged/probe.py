"""Count transformers' own prefix hits, with no store: the baseline's "hit tokens per tier".

:class:`PrefixProbe` hooks only ``cache.search_prefix_match`` of one manager (per instance,
like the connector) and records each admission's matched tokens under the ``"paged"`` source,
so transformers' continuous batching without kvtier reports its cache hits the way the
connector does (``probe.admissions``), and changes nothing else.
"""

from __future__ import annotations

from typing import Any

from kvtier.connectors.hf_paged.admissions import PAGED, Admission, Admissions
from kvtier.connectors.hf_paged.hooks import Hooks


class PrefixProbe:
    """Records ``Admission(request_id, prompt_tokens, {"paged": matched})`` per request."""

    def __init__(self) -> None:
        self.admissions = Admissions()
        self._hooks = Hooks()

    def attach(self, manager: Any) -> None:
        self._hooks.on_batch_processors(manager, self._install)

    def detach(self) -> None:
        self._hooks.restore()

    def _install(self, processor: Any) -> None:
        self._hooks.wrap(processor.cache, "search_prefix_match", self._admit)

    def _admit(self, original: Any, request_id: str, prompt_ids: list[int]) -> int:
        matched = original(request_id, prompt_ids)
        self.admissions.record(Admission(request_id, len(prompt_ids), {PAGED: matched} if matched else {}))
        return matched
