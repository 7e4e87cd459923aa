"""TTFT saved: what the cached tokens would have cost to prefill, minus the load time spent.

A connector times each prefill it drives (the engine's forward over the tokens it computes)
and feeds ``(computed_tokens, seconds)`` to a :class:`PrefillRate` of its model. The rate is
the slope ``b`` of a line ``seconds = a + b * tokens`` through the last ``window`` prefills, so
that the fixed cost of a forward (``a``: kernel launches, sampling) is not charged to each
token; ``b`` is the prefill's marginal cost per token. The slope is Theil-Sen's (the median of
the slopes between every two prefills; Sen, JASA 1968): one slow outlier (a first call, a
busy host) moves it little, where it would tilt a least-squares line. A request that loaded ``n`` cached tokens in
``load_s`` seconds saved ``n * b - load_s`` seconds of TTFT: counted in ``ttft_saved_s`` when
positive, in ``ttft_lost_s`` when the load cost more than recomputing would have
(``TieredStore.record_computed_tokens``). Prefill time grows faster than linearly with long
contexts (attention), so ``b`` fitted on the prompt lengths the engine actually serves is
what keeps the estimate honest; it is an estimate, not a measurement of the counterfactual.

:class:`ForwardTimer` times the first forward of a ``torch.nn.Module`` after :meth:`arm`
(with transformers' ``generate``, that forward is the prefill): host time on CPU, CUDA
events on a GPU (read once the forward finished, so timing adds no synchronisation).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Any

WINDOW = 64
"""Prefills the fit keeps (recent ones: the engine's speed changes with load and lengths)."""
MIN_SPREAD_TOKENS = 16
"""Below this spread of computed tokens the fit is not trusted; the median of seconds per
token is used instead."""


class PrefillRate:
    """Seconds per computed prompt token of one model, from its recent prefills."""

    def __init__(self, window: int = WINDOW) -> None:
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)

    def __len__(self) -> int:
        return len(self._samples)

    def observe(self, computed_tokens: int, seconds: float) -> None:
        """One prefill of ``computed_tokens`` (> 0) that took ``seconds``."""
        if computed_tokens > 0 and seconds > 0:
            self._samples.append((computed_tokens, seconds))

    def seconds_per_token(self) -> float | None:
        """The fitted marginal cost ``b`` (seconds per token), or ``None`` before any prefill;
        the median seconds per token when the prefills' lengths barely differ or the slope
        is not positive."""
        if not self._samples:
            return None
        samples = list(self._samples)
        xs = [n for n, _ in samples]
        if max(xs) - min(xs) >= MIN_SPREAD_TOKENS:
            slopes = [(t2 - t1) / (n2 - n1) for i, (n1, t1) in enumerate(samples) for n2, t2 in samples[i + 1 :]
                      if abs(n2 - n1) >= MIN_SPREAD_TOKENS]
            slope = statistics.median(slopes)
            if slope > 0:
                return slope
        return statistics.median(t / n for n, t in samples)

    def saving(self, cached_tokens: int, load_s: float) -> tuple[float, float] | None:
        """``(saved_s, lost_s)`` for a request that loaded ``cached_tokens`` in ``load_s``
        seconds (one of them 0), or ``None`` before any prefill was timed."""
        rate = self.seconds_per_token()
        if rate is None:
            return None
        net = cached_tokens * rate - max(load_s, 0.0)
        return (net, 0.0) if net >= 0 else (0.0, -net)


class ForwardTimer:
    """Times the first forward of ``module`` after each :meth:`arm` (module hooks).

    Args:
        module: the model (its ``forward`` runs once per generation step).
    """

    def __init__(self, module: Any) -> None:
        self._armed = False
        self._start: Any = None
        self._end: Any = None
        self._handles = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]

    def arm(self) -> None:
        """Time the next forward (forgets an unfinished one)."""
        self._armed, self._start, self._end = True, None, None

    def seconds(self) -> float | None:
        """Duration of the forward timed since :meth:`arm`, or ``None`` if none ran; disarms."""
        start, end = self._start, self._end
        self._armed, self._start, self._end = False, None, None
        if start is None or end is None:
            return None
        if isinstance(start, float):
            return end - start
        end.synchronize()  # CUDA events: the forward was queued; it has long finished by now
        return start.elapsed_time(end) / 1e3

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _pre(self, module: Any, args: Any) -> None:
        if self._armed and self._start is None:
            self._start = _now(module)

    def _post(self, module: Any, args: Any, output: Any) -> None:
        if self._armed and self._start is not None and self._end is None:
            self._end = _now(module)
            self._armed = False


def _now(module: Any) -> Any:
    """``time.perf_counter()`` on CPU; a recorded CUDA event on a GPU."""
    device = getattr(module, "device", None)
    if device is not None and getattr(device, "type", "cpu") == "cuda":
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()
