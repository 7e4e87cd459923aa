"""Asynchronous block transfers between media: the engine, its handlers, and prefetch."""

from kvtier.transfer.engine import JobResult, TransferEngine, TransferHandler, TransferJob

__all__ = ["JobResult", "TransferEngine", "TransferHandler", "TransferJob"]
