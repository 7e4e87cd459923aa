"""The daemon's event loop: uvloop when it is installed (``pip install 'kvtier[fast]'``), else
asyncio's own.

uvloop (libuv, Cython) runs the same aiohttp app; its transports send from the buffers they
are given, so a get hands a whole chunk of frames (the pool's slots) to the socket without a
copy (kvtier.server.streams): in bench/server.py (2 cores) the get costs ~25% less server CPU
per GB than on asyncio's loop, which copies what the socket does not take at once; lookups
and puts cost about the same on both (bench/results/2026-12-01-perf). It stays optional: some
images (the device image) have no wheel for it, and everything the daemon guarantees
(deadlines, budgets, strict parsing) is asyncio's API, which both loops implement (the
deadline tests run on both).

Chosen by ``ServeConfig.event_loop`` (``KVTIER_EVENT_LOOP``): ``auto`` (uvloop if importable),
``uvloop`` (required: a ``ValueError`` without it) or ``asyncio``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

EVENT_LOOPS = ("auto", "uvloop", "asyncio")
T = TypeVar("T")


def loop_factory(choice: str = "auto") -> tuple[Callable[[], asyncio.AbstractEventLoop], str]:
    """``(new event loop factory, "uvloop X.Y.Z" | "asyncio")`` for ``choice`` (:data:`EVENT_LOOPS`).

    Raises:
        ValueError: an unknown choice, or ``uvloop`` when it is not installed.
    """
    if choice not in EVENT_LOOPS:
        raise ValueError(f"expected an event loop in {list(EVENT_LOOPS)}, got {choice!r}")
    if choice != "asyncio":
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise ValueError("expected uvloop to be installed for event_loop=uvloop "
                                 "(pip install 'kvtier[fast]')") from None
        else:
            return uvloop.new_event_loop, f"uvloop {uvloop.__version__}"
    return asyncio.new_event_loop, "asyncio"


def running() -> str:
    """The running loop's name: ``"uvloop X.Y.Z"`` or ``"asyncio"`` (what the daemon logs)."""
    if type(asyncio.get_running_loop()).__module__.startswith("uvloop"):
        import uvloop

        return f"uvloop {uvloop.__version__}"
    return "asyncio"


def run(main: Coroutine[Any, Any, T], choice: str = "auto") -> T:
    """``asyncio.run(main)`` on the loop :func:`loop_factory` picks."""
    factory, _ = loop_factory(choice)
    runner_cls = getattr(asyncio, "Runner", None)  # Python >= 3.11
    if runner_cls is not None:
        with runner_cls(loop_factory=factory) as runner:
            return runner.run(main)
    if factory is not asyncio.new_event_loop:  # Python 3.10: through the policy
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return asyncio.run(main)
