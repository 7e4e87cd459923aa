"""Which transformers releases the continuous-batching connector supports, and how to tell.

The connector plugs into transformers' paged cache below its public API (the prefix match, the
block ledger, the cache tensor's layout, the scheduler's waiting list), so it names the
releases whose internals it was built and tested against. Two generations exist:

- ``"block_manager"`` (transformers 5.17): ``continuous_batching/cache_manager.py``, one
  ``BlockManager`` with ``Block`` objects and per-layer ``key_cache`` / ``value_cache``
  tensors ``[(num_blocks + 2) * block_size, num_kv_heads, head_dim]``; the page size is
  ``ContinuousBatchingConfig.block_size``.
- ``"allocators"`` (transformers 5.18 to 5.25): ``continuous_batching/cache_allocators/``, a
  ``BlockLedger`` per allocator and one flat cache tensor cut into sectors, blocks and pages;
  the page size is ``ContinuousBatchingConfig.page_size``.

:func:`check_transformers` raises :class:`UnsupportedTransformersError` (naming the version
found and the supported range) before anything is hooked; tests/unit/connectors/test_hf_paged_contract.py
checks every internal the connector touches on the installed release and names the one that
moved when a release changes it.
"""

from __future__ import annotations

from typing import Literal

SUPPORTED_TRANSFORMERS = ">=5.17,<5.26"
"""The releases whose continuous-batching internals the connector was checked against (5.25,
2026-12-03: the contract test and the connector's tests pass unchanged; its one change there,
an MLA allocator, serves models the connector refuses, :class:`.layout.AllocatorsLayout`); the
``continuous`` extra in pyproject.toml pins the same range (tests/unit/connectors/test_hf_paged_contract.py)."""

Generation = Literal["block_manager", "allocators"]


class UnsupportedTransformersError(RuntimeError):
    """The installed transformers release is outside :data:`SUPPORTED_TRANSFORMERS`, or its
    continuous-batching internals are not the ones the connector knows."""


def transformers_version() -> tuple[int, int, int]:
    """``(major, minor, patch)`` of the installed transformers (pre-release tags dropped)."""
    import transformers

    parts = []
    for piece in transformers.__version__.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit()) if not piece.isdigit() else piece
        parts.append(int(digits or 0))
    while len(parts) < 3:
        parts.append(0)
    return parts[0], parts[1], parts[2]


def supported(version: tuple[int, int, int]) -> bool:
    """Whether ``version`` is in :data:`SUPPORTED_TRANSFORMERS`."""
    return (5, 17, 0) <= version < (5, 26, 0)


def check_transformers() -> Generation:
    """The internals generation of the installed transformers.

    Raises:
        UnsupportedTransformersError: the release is outside the supported range, or its
            continuous-batching package lacks the modules of its generation.
    """
    import transformers

    version = transformers_version()
    if not supported(version):
        raise UnsupportedTransformersError(
            f"kvtier's continuous-batching connector supports transformers {SUPPORTED_TRANSFORMERS} (it plugs "
            f"into the paged cache's internals, which change between releases); found {transformers.__version__}. "
            f"Install a supported release: pip install 'transformers{SUPPORTED_TRANSFORMERS}'"
        )
    generation: Generation = "block_manager" if version < (5, 18, 0) else "allocators"
    module = {
        "block_manager": "transformers.generation.continuous_batching.cache_manager",
        "allocators": "transformers.generation.continuous_batching.cache_allocators",
    }[generation]
    try:
        __import__(module)
    except ImportError as exc:
        raise UnsupportedTransformersError(
            f"transformers {transformers.__version__} has no {module} (expected for its release): the "
            f"continuous-batching internals moved; kvtier supports transformers {SUPPORTED_TRANSFORMERS}"
        ) from exc
    return generation
