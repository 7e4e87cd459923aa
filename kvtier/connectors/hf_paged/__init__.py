"""kvtier under transformers' continuous batching: hits become paged blocks, not copies.

:class:`HFPagedConnector` hooks one ``ContinuousBatchingManager`` (per instance, removed by
``detach``/``close``): prefetch when a request is added, load the rest of the chain after
transformers' own prefix match straight into the request's paged blocks (shared with later
requests through transformers' block sharing), store each forward's newly computed blocks.
See :mod:`.connector` for the flow, :mod:`.layout` for the cache layouts and :mod:`.compat`
for the supported transformers releases.
"""

from kvtier.connectors.hf_paged.admissions import PAGED, Admission, PagedStats
from kvtier.connectors.hf_paged.compat import SUPPORTED_TRANSFORMERS, UnsupportedTransformersError, check_transformers
from kvtier.connectors.hf_paged.connector import HFPagedConnector, page_size_of
from kvtier.connectors.hf_paged.models import UnsupportedModelError, check_model

__all__ = [
    "PAGED",
    "SUPPORTED_TRANSFORMERS",
    "Admission",
    "HFPagedConnector",
    "PagedStats",
    "UnsupportedModelError",
    "UnsupportedTransformersError",
    "check_model",
    "check_transformers",
    "page_size_of",
]
