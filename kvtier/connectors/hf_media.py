"""Images in a transformers prompt: their placeholder runs, content hashes and the processor
outputs the suffix prefill still needs (the HF connector's half of issue 11, item 3).

A vision-language model's processor expands each image into a run of image tokens
(``config.image_token_id``) in ``input_ids`` and returns the image's pixels in per-image
tensors (``pixel_values`` ``[num_images, C, H, W]``, and e.g. ``image_sizes``
``[num_images, 2]``). :func:`prompt_media` pairs the ``i``-th run with the ``i``-th image and
hashes the image's tensors (:func:`kvtier.media.content_hash`): the blocks its run falls in
are keyed by that hash (:func:`kvtier.media.block_extra_keys`).

transformers embeds an image in the prefill whose ``input_ids`` hold its whole placeholder
run, from the ``pixel_values`` passed to that prefill (5.17 and 5.24: the multimodal inputs
go to the first forward only, and the image features must match the image tokens of that
forward). So a hit never ends inside an image (:func:`kvtier.media.whole_items_prefix`), and
the suffix prefill gets the tensors of the images after the cached prefix only
(:meth:`PromptMedia.inputs_after`).

What cannot be keyed this way, and is then not cached (``PromptMedia.problem`` says why): a
processor output that is neither per image nor ``input_ids``/``attention_mask``
(per-token ``token_type_ids``, flattened patches with ``image_grid_thw``: Gemma 3, Qwen2-VL),
image runs that do not pair one to one with the images (two adjacent images without a token
between them), a batch of more than one prompt.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.media import MediaItem, block_extra_keys, content_hash, whole_items_prefix

logger = logging.getLogger(__name__)

TOKEN_INPUTS = frozenset({"input_ids", "attention_mask"})
"""Processor outputs that are the prompt's own (the caller passes them to ``generate``)."""


@dataclass
class PromptMedia:
    """The images of one prompt.

    Attributes:
        items: one per image, in prompt order (placeholder run and content hash).
        per_image: processor outputs split per image, ``{name: [tensor of image i, ...]}``
            (each tensor keeps a leading dimension of 1).
        raw: the processor outputs other than ``input_ids``/``attention_mask``, as given.
        problem: why the images cannot be keyed (the prompt is then not cached), or ``None``.
    """

    items: list[MediaItem] = field(default_factory=list)
    per_image: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None

    @property
    def keyable(self) -> bool:
        return self.problem is None

    def extra_keys(self, num_blocks: int, block_size: int) -> list[bytes] | None:
        """Per-block extra keys of blocks ``0 .. num_blocks - 1`` (``None``: no image)."""
        return block_extra_keys(self.items, num_blocks, block_size) if self.items else None

    def cut(self, num_blocks: int, block_size: int) -> int:
        """The blocks of a hit of ``num_blocks`` that may be used: none of an unkeyable
        prompt, and never ending inside an image (module docstring)."""
        return whole_items_prefix(self.items, num_blocks, block_size) if self.keyable else 0

    def inputs_after(self, num_cached_tokens: int) -> dict[str, Any]:
        """The processor outputs a prefill of the prompt after ``num_cached_tokens`` needs:
        the per-image tensors of the images that start at or after it, concatenated along
        dim 0 (``{}`` when every image is cached); all of them for an unkeyable prompt."""
        if not self.keyable:
            return dict(self.raw)
        keep = [i for i, item in enumerate(self.items) if item.start >= num_cached_tokens]
        if not keep:
            return {}
        return {name: torch.cat([parts[i] for i in keep]) for name, parts in self.per_image.items()}


def image_token_id(config: Any) -> int | None:
    """The placeholder token id of images in ``config`` (``image_token_id``, or the older
    ``image_token_index``), ``None`` for a model without one."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def prompt_media(inputs: Mapping[str, Any], config: Any, input_ids: list[int]) -> PromptMedia:
    """The images of a prompt from its processor outputs; when they cannot be keyed (module
    docstring) ``problem`` says why (and it is logged).

    Args:
        inputs: the processor outputs (a ``BatchFeature`` or dict): per-image tensors, and
            optionally ``input_ids`` (``[1, n]``, must be ``input_ids``) and ``attention_mask``.
        config: the model config (its image token id).
        input_ids: the prompt's token ids, ``[n]``.
    """
    token = image_token_id(config)
    runs = _runs(input_ids, token) if token is not None else []
    tensors = {k: v for k, v in inputs.items() if k not in TOKEN_INPUTS and v is not None}
    problem = _check(inputs, tensors, runs, input_ids, token)
    if problem is not None:
        logger.warning("kvtier: this prompt's media cannot be keyed (%s); it is not cached", problem)
        return PromptMedia(raw=tensors, problem=problem)
    per_image = {name: list(value.split(1)) for name, value in tensors.items()}
    items = []
    for i, (start, length) in enumerate(runs):
        parts = b"".join(name.encode() + b"|" + content_hash(per_image[name][i]) for name in sorted(per_image))
        items.append(MediaItem(start, length, content_hash(parts)))
    return PromptMedia(items, per_image, tensors)


def _runs(input_ids: list[int], token: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each maximal run of ``token``."""
    runs: list[tuple[int, int]] = []
    for pos, t in enumerate(input_ids):
        if t != token:
            continue
        if runs and runs[-1][0] + runs[-1][1] == pos:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((pos, 1))
    return runs


def _check(inputs, tensors: dict, runs: list, input_ids: list[int], token: int | None) -> str | None:
    """Why these processor outputs cannot be keyed, or ``None``."""
    given = inputs.get("input_ids")
    if given is not None and (not isinstance(given, torch.Tensor) or given.reshape(-1).tolist() != input_ids):
        return "the processor's input_ids are not the prompt's"
    if token is None:
        return "the model config names no image token" if tensors else None
    if not tensors:
        return f"{len(runs)} image token runs but no image tensors" if runs else None
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != len(runs):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            return f"{name} {shape} is not one entry per image ({len(runs)} image token runs)"
    return None
