"""Asynchronous block transfers between media: the engine and its handlers (prefetch, which
plans them, is kvtier.store.prefetch)."""

from kvtier.transfer.engine import JobResult, TransferEngine, TransferHandler, TransferJob

__all__ = ["JobResult", "TransferEngine", "TransferHandler", "TransferJob"]
