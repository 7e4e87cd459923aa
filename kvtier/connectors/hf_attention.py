"""Causal attention for the prefill that follows a hit (transformers' SDPA path).

Why: transformers builds no mask for a prefill that starts at position 0 (query length ==
key length) and lets SDPA run ``is_causal=True``, whose kernels skip the key blocks above the
diagonal. After a hit the prefill's queries are the prompt's last ``q`` tokens and its keys
all ``kv`` (cached prefix + suffix); SDPA's ``is_causal`` is aligned top-left, so transformers
passes a materialized ``[1, 1, q, kv]`` boolean mask instead, and the masked kernel computes
every key block of every query: the whole ``q x kv`` rectangle where the full prefill
computed a triangle. Measured on SmolLM2-135M (fp32, 2 CPU cores, torch 2.13, transformers
5.24; ``torch.profiler``, self time of ``_scaled_dot_product_flash_attention_for_cpu`` over
the 30 layers): a 1,054-token prompt's prefill spends 560 ms in attention without a cache,
971 ms after a one-block (16-token) hit, 855 ms after 128 tokens; the hit made that request's
TTFT slower than no cache at all (the demo's first-turn goal, issue 17). transformers notes
the same dispatch rule for its StaticCache prefill (``sdpa_attention_forward``: "sdpa will
only dispatch to flash kernel if and only if q_length == kv_length").

What: during the one forward after ``before_prefill`` served a hit (:class:`PrefixAttention`,
armed by the connector, like its prefill timer), the text config's attention implementation
``"sdpa"`` is swapped for :data:`ATTN_IMPLEMENTATION`, :func:`prefix_causal_sdpa`: where the
mask is exactly the lower-right causal mask of a batch of one and the cached prefix is under
:data:`MAX_PREFIX_SHARE` of the keys, it puts ``kv - q`` rows of zeros in front of the
queries, runs transformers' own ``sdpa_attention_forward`` with ``is_causal=True`` and no
mask (the shapes of the full prefill: the same kernel, the same blocking), and returns the
last ``q`` rows. Every real query row sees exactly the keys it sees under the mask; each row
of an attention output depends only on its own query, so the zero rows change nothing but
cost ``(kv - q) * kv / 2`` extra scores, less than the rectangle's extra half up to
:data:`MAX_PREFIX_SHARE`. Any other call (another mask, sliding windows, a position bias,
soft-capping, sinks, batches, decode steps) goes to ``sdpa_attention_forward`` unchanged. The
same prompt's logits after a 16/128/400-token hit equal the full prefill's bit for bit
(SmolLM2, 1,054 tokens, on the CPU; on CUDA the masked and the causal kernels differ, so
the masked path may differ from both by rounding); attention time after a 16-token hit
574 ms (from 971 ms; 560 ms with no cache). The swap is undone when that forward returns or raises, so ``generate``'s decode
steps, transformers' continuous batching (which accepts ``"sdpa"`` only) and other users of
the model see ``"sdpa"``.

Works where transformers has ``AttentionInterface`` and ``AttentionMaskInterface`` (all the
versions kvtier supports, 4.56+); elsewhere, or for a model on another implementation (eager,
flash, flex), nothing changes. One inference loop per model, as for the connector: the swap
and the arming belong to the model, not to a thread (a forward on another thread while armed
may take the arming; its results stay exact, the attention either way computing the same).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

logger = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "kvtier_prefix_sdpa"
"""The name :func:`prefix_causal_sdpa` is registered under in transformers' interfaces."""

MAX_PREFIX_SHARE = 0.4
"""The padded call runs when the cached prefix is under this share of the keys. Its scores:
the ``kv x kv`` triangle; the mask's: the ``q x kv`` rectangle, computed at about 0.9x the
cost per score on the CPU (measured as above): equal near a 40% prefix."""

_sdpa_forward: Any = None


def _register() -> bool:
    """Register :func:`prefix_causal_sdpa` and SDPA's mask function under
    :data:`ATTN_IMPLEMENTATION` (once). ``False`` where transformers lacks the interfaces."""
    global _sdpa_forward
    if _sdpa_forward is not None:
        return True
    try:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as exc:  # transformers < 4.53
        logger.debug("prefix attention off: %s", exc)
        return False
    AttentionInterface.register(ATTN_IMPLEMENTATION, prefix_causal_sdpa)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    _sdpa_forward = sdpa_attention_forward
    return True


def is_lower_right_causal(mask: Any, q_len: int, kv_len: int) -> bool:
    """Whether ``mask`` (``[1, 1, q_len, kv_len]`` bool, True = attend) lets query ``i`` see
    exactly keys ``0 .. kv_len - q_len + i``: a causal prefill after ``kv_len - q_len`` cached
    tokens, no padding, no window.

    The answers for the last few masks checked are kept (weak reference, data pointer and
    version counter; forgotten when an armed forward starts and ends): transformers builds
    one mask per layer type and hands the same tensor to every layer of that type, so a
    forward compares each mask once, whatever the order of its sliding and full layers
    (a 4k-token prompt's mask is 16M elements, and on CUDA the comparison is a host sync)."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4:
        return False
    if tuple(mask.shape) != (1, 1, q_len, kv_len):
        return False
    for ref, data_ptr, version, answer in _checked:
        if ref() is mask and data_ptr == mask.data_ptr() and version == _version(mask):
            return answer
    expected = torch.ones(q_len, kv_len, dtype=torch.bool, device=mask.device).tril(kv_len - q_len)
    answer = bool(torch.equal(mask[0, 0], expected))
    _checked.append((weakref.ref(mask), mask.data_ptr(), _version(mask), answer))
    del _checked[:-_MEMO_SIZE]
    return answer


def _version(t: torch.Tensor) -> int:
    """The in-place version counter; -1 for an inference tensor, which has none (the answers
    are then forgotten at the start and end of every armed forward: :class:`PrefixAttention`)."""
    return -1 if t.is_inference() else t._version


def forget_checked_masks() -> None:
    """Drop the remembered answers of :func:`is_lower_right_causal`."""
    _checked.clear()


_MEMO_SIZE = 4
"""Masks remembered: one per layer type of a forward (full, sliding, chunked) and a spare."""
_checked: list[tuple[Any, int, int, bool]] = []


_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks", "position_bias")
"""Arguments that change the scores (a tensor, a float): given at all, the call is not a plain
causal one (a tensor's truth value is never asked)."""


def prefix_causal_sdpa(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
    is_causal: bool | None = None, **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """transformers' ``sdpa_attention_forward`` (same arguments and result: ``query``
    ``[batch, num_heads, q_len, head_dim]``, ``key``/``value`` ``[batch, num_kv_heads, kv_len,
    head_dim]`` after the cache update; returns ``([batch, q_len, num_heads, head_dim], None)``),
    computing a prefill after a cached prefix as the causal full prefill does (module
    docstring)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    prefix = kv_len - q_len
    if (1 < q_len < kv_len and prefix < MAX_PREFIX_SHARE * kv_len and query.shape[0] == 1
            and is_causal is not False and getattr(module, "is_causal", True) and dropout == 0.0
            and all(kwargs.get(name) is None for name in _UNSUPPORTED_KWARGS) and not kwargs.get("output_attentions")
            and is_lower_right_causal(attention_mask, q_len, kv_len)):
        padded = torch.cat([query.new_zeros(*query.shape[:2], prefix, query.shape[3]), query], dim=2)
        out, weights = _sdpa_forward(module, padded, key, value, None, dropout=dropout, scaling=scaling,
                                     is_causal=True, **kwargs)
        return out[:, prefix:], weights
    return _sdpa_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                         is_causal=is_causal, **kwargs)


class PrefixAttention:
    """Runs the first forward of ``model`` after each :meth:`arm` on
    :func:`prefix_causal_sdpa` (module docstring), when the model's text config uses
    ``"sdpa"``; a no-op otherwise.

    Args:
        model: a transformers model (its ``config`` or ``config.get_text_config()`` names the
            decoder's attention implementation).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        config = getattr(model, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self._config = text if hasattr(text, "_attn_implementation_internal") else None
        self._armed = False
        self._swapped = False
        self._handles: list[Any] = []
        if self._config is not None and _register():
            self._handles = [model.register_forward_pre_hook(self._pre),
                             model.register_forward_hook(self._post, always_call=True)]

    @property
    def enabled(self) -> bool:
        """Hooks installed (transformers has the interfaces; the model has a config)."""
        return bool(self._handles)

    def arm(self) -> None:
        """The model's next forward (the prefill after a hit) uses the prefix attention."""
        self._restore()  # a swap left by a forward interrupted by a BaseException (see _post)
        self._armed = bool(self._handles)

    def disarm(self) -> None:
        """The next forward runs on the model's own implementation (a prefill after a miss)."""
        self._restore()
        self._armed = False

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._restore()

    def _pre(self, module: Any, args: Any) -> None:
        if not self._armed:
            self._restore()  # stale: the armed forward ended in a BaseException
            return
        self._armed = False
        forget_checked_masks()
        if self._config._attn_implementation_internal == "sdpa":
            self._config._attn_implementation_internal = ATTN_IMPLEMENTATION
            self._swapped = True

    def _post(self, module: Any, args: Any, output: Any) -> None:
        # always_call: torch runs this after an Exception too, but not after a BaseException
        # (KeyboardInterrupt): then the next arm, disarm, forward or close restores "sdpa"
        self._restore()

    def _restore(self) -> None:
        forget_checked_masks()
        if self._swapped:
            self._swapped = False
            if self._config._attn_implementation_internal == ATTN_IMPLEMENTATION:
                self._config._attn_implementation_internal = "sdpa"
