"""Images in a token-in-token-out system: what a prompt's images become, and the positions they take.

A prompt with images is token ids plus an :class:`Images` record. The ids hold, per image,
``<|vision_start|>``, one ``<|image_pad|>`` per merged patch (``t * h * w / merge**2`` of the image's
grid) and ``<|vision_end|>``; the record holds the image processor's output for all of the prompt's
images in order (``pixel_values [N_patches, C * temporal_patch * patch**2]``, ``grid_thw [n_images, 3]``)
and a sha256 of both (``digest``), which is what caches key on: two prompts with equal ids and
different pictures differ in their digest. Nothing is re-encoded later: engines, the trainer and the
warm start all take these same ids and pixels.

Positions (Qwen2-VL's multimodal RoPE, :func:`mrope_positions`): text tokens advance all three
position streams (temporal, height, width) together; an image's tokens take ``start + (0, row, col)``
over its merged grid, and the text after it continues from ``start + max(h, w) / merge``. A sequence's
``delta`` is ``max position + 1 - length``: token ``t`` generated after the prompt sits at position
``t + delta`` in all three streams, so a decode step needs the row's delta only.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


def is_vision_config(config: Any) -> bool:
    """Whether an HF config is a vision-language model's (it has a ``vision_config``)."""
    return getattr(config, "vision_config", None) is not None


def load_model(path: str, dtype: torch.dtype, **kwargs: Any) -> Any:
    """The HF model at ``path``: ``AutoModelForImageTextToText`` for a vision-language checkpoint,
    else ``AutoModelForCausalLM``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    cls = (
        AutoModelForImageTextToText
        if is_vision_config(AutoConfig.from_pretrained(path))
        else AutoModelForCausalLM
    )
    return cls.from_pretrained(path, dtype=dtype, **kwargs)


@dataclass(frozen=True, eq=False)
class Images:
    """A prompt's images after the image processor (all of them, in prompt order)."""

    pixel_values: torch.Tensor  # [N_patches, D] fp32
    grid_thw: torch.Tensor  # [n_images, 3] int64: temporal, height, width patches
    digests: tuple[str, ...]  # per image: sha256 of its grid and pixel values (the content key of caches)

    @staticmethod
    def of(pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> Images:
        pv = pixel_values.detach().float().contiguous().cpu()
        grid = grid_thw.detach().long().contiguous().cpu()
        digests, lo = [], 0
        for g in grid:
            hi = lo + int(g.prod())
            h = hashlib.sha256(g.numpy().tobytes())
            h.update(pv[lo:hi].numpy().tobytes())
            digests.append(h.hexdigest())
            lo = hi
        if lo != pv.shape[0]:
            raise ValueError(f"Images: grids cover {lo} patches, pixel_values has {pv.shape[0]}")
        return Images(pixel_values=pv, grid_thw=grid, digests=tuple(digests))

    @property
    def digest(self) -> str:
        """One key for all of the prompt's images."""
        return hashlib.sha256("".join(self.digests).encode()).hexdigest()

    def __len__(self) -> int:
        return int(self.grid_thw.shape[0])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Images) and other.digests == self.digests

    def __hash__(self) -> int:
        return hash(self.digests)


def cat_images(items: Sequence[Images | None]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Pixel values and grids of several prompts' images, concatenated in order (None: no images)."""
    present = [x for x in items if x is not None and len(x)]
    if not present:
        return None
    return torch.cat([x.pixel_values for x in present]), torch.cat([x.grid_thw for x in present])


def load_image(source: Any, *, where: str) -> Any:
    """An RGB PIL image from a path, bytes or a PIL image; ``where`` names it in errors (file, row, field)."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Image.Image):
        return source.convert("RGB")
    try:
        if isinstance(source, bytes | bytearray):
            img = Image.open(io.BytesIO(source))
        elif isinstance(source, str | Path):
            p = Path(source).expanduser()
            if not p.is_file():
                raise ValueError(f"{where}: image file {str(p)!r} does not exist")
            img = Image.open(p)
        else:
            raise ValueError(f"{where}: an image must be a file path or bytes, found {type(source).__name__}")
        img.load()
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(f"{where}: unreadable image ({e})") from None
    return img.convert("RGB")


def image_token_ids(tokenizer: Any) -> tuple[int, int, int]:
    """Ids of ``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>`` in ``tokenizer``."""
    from miles.models.qwen_vl import VISION_TOKENS

    ids = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    if any(i is None or i == tokenizer.unk_token_id for i in ids):
        raise ValueError(
            f"the tokenizer has no vision tokens {VISION_TOKENS}: is this a vision-language checkpoint?"
        )
    return tuple(int(i) for i in ids)  # type: ignore[return-value]


def encode_image_prompt(
    tokenizer: Any,
    image_processor: Any,
    text: str,
    images: Sequence[Any],
    chat_template: bool = True,
    cache: dict | None = None,
) -> tuple[tuple[int, ...], Images | None]:
    """Prompt ids (images first, then ``text``, as one user turn) and their :class:`Images`.

    Each image becomes ``<|vision_start|>`` + ``<|image_pad|>`` x (merged patches) + ``<|vision_end|>``.
    ``cache`` (optional) keeps processed images by their bytes (images given as bytes only).
    """
    from miles.models.qwen_vl import VISION_TOKENS
    from miles.models.tokenizer import encode_prompt

    if not images:
        return tuple(encode_prompt(tokenizer, text, chat_template)), None
    start, pad, end = VISION_TOKENS
    content = f"{start}{pad}{end}" * len(images) + text
    ids = encode_prompt(tokenizer, content, chat_template)
    key = tuple(images) if cache is not None and all(isinstance(x, bytes) for x in images) else None
    imgs = cache.get(key) if key is not None else None  # type: ignore[union-attr]
    if imgs is None:
        out = image_processor(images=[load_image(x, where="image") for x in images], return_tensors="pt")
        imgs = Images.of(out["pixel_values"], out["image_grid_thw"])
        if key is not None:
            cache[key] = imgs  # type: ignore[index]
    merge = int(getattr(image_processor, "merge_size", 2))
    counts = iter((imgs.grid_thw.prod(-1) // merge**2).tolist())
    pad_id = image_token_ids(tokenizer)[1]
    expanded: list[int] = []
    for i in ids:
        expanded.extend([pad_id] * next(counts) if i == pad_id else [i])
    return tuple(expanded), imgs


def sequence_positions(
    prompt: Sequence[int], num_response: int, grid_thw: torch.Tensor | None, image_token_id: int, merge: int
) -> torch.Tensor:
    """mRoPE positions [3, P + R] of a prompt and its ``num_response`` generated tokens.

    Response tokens are text whatever their id (a policy may sample the image placeholder): token ``t``
    after the prompt sits at ``P + t + delta`` in all three streams, as the engine's decode steps put it.
    """
    pos, delta = mrope_positions(prompt, grid_thw, image_token_id, merge)
    tail = torch.arange(len(prompt), len(prompt) + num_response) + delta
    return torch.cat([pos, tail.expand(3, num_response)], dim=1)


def mrope_positions(
    ids: Sequence[int], grid_thw: torch.Tensor | None, image_token_id: int, merge: int
) -> tuple[torch.Tensor, int]:
    """Multimodal RoPE positions of one unpadded sequence: ``([3, T] int64, delta)``.

    Each maximal run of ``image_token_id`` is the next image of ``grid_thw``; a run whose length is not
    that image's merged patch count raises ValueError. Without images: ``arange(T)`` three times, delta 0.
    """
    n = len(ids)
    t = torch.as_tensor(list(ids), dtype=torch.long)
    if grid_thw is None or not len(grid_thw):
        return torch.arange(n).expand(3, n).clone(), 0
    is_img = (t == image_token_id).tolist()
    out = torch.empty(3, n, dtype=torch.long)
    grids = iter(grid_thw.tolist())
    i, cur = 0, 0
    while i < n:
        j = i
        while j < n and is_img[j] == is_img[i]:
            j += 1
        if not is_img[i]:
            out[:, i:j] = torch.arange(cur, cur + j - i)
            cur += j - i
        else:
            try:
                gt, gh, gw = next(grids)
            except StopIteration:
                raise ValueError("mrope_positions: more image-token runs than images in grid_thw") from None
            h, w = gh // merge, gw // merge
            if j - i != gt * h * w:
                raise ValueError(
                    f"mrope_positions: an image run of {j - i} tokens, but its grid {gt}x{gh}x{gw} "
                    f"with merge {merge} needs {gt * h * w}"
                )
            tt, hh, ww = torch.meshgrid(torch.arange(gt), torch.arange(h), torch.arange(w), indexing="ij")
            out[:, i:j] = torch.stack([tt, hh, ww]).reshape(3, -1) + cur
            cur += max(h, w)
        i = j
    return out, int(out.max()) + 1 - n
