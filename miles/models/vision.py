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
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
"""Added to a built tokenizer, in this order: the image placeholder is expanded to one token per merged patch."""

PLACEHOLDER = "".join(VISION_TOKENS)
"""One image in a text before :func:`expand_images`: its start token, one pad, its end token."""


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

    def __add__(self, other: Images) -> Images:
        """These images followed by ``other``'s (a conversation's images, turn by turn)."""
        return Images(pixel_values=torch.cat([self.pixel_values, other.pixel_values]),
                      grid_thw=torch.cat([self.grid_thw, other.grid_thw]), digests=self.digests + other.digests)

    @property
    def nbytes(self) -> int:
        """Bytes of the pixel values."""
        return self.pixel_values.numel() * self.pixel_values.element_size()

    def token_counts(self, merge: int) -> list[int]:
        """Image tokens of each image: its merged patches."""
        return (self.grid_thw.prod(-1) // merge**2).tolist()

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
    ids = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    if any(i is None or i == tokenizer.unk_token_id for i in ids):
        raise ValueError(
            f"the tokenizer has no vision tokens {VISION_TOKENS}: is this a vision-language checkpoint?"
        )
    return tuple(int(i) for i in ids)  # type: ignore[return-value]


class ImageCache:
    """Processed pictures by their bytes, at most ``max_bytes`` of pixel values: the least recently used
    entries go first (a task with many distinct pictures keeps only the recent ones)."""

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes, self.bytes, self.evictions = max_bytes, 0, 0
        self._entries: OrderedDict[Any, Images] = OrderedDict()

    def get(self, key: Any) -> Images | None:
        found = self._entries.get(key)
        if found is not None:
            self._entries.move_to_end(key)
        return found

    def __setitem__(self, key: Any, images: Images) -> None:
        if key in self._entries or images.nbytes > self.max_bytes:
            return
        self._entries[key] = images
        self.bytes += images.nbytes
        while self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.nbytes
            self.evictions += 1

    def __len__(self) -> int:
        return len(self._entries)


def process_images(image_processor: Any, images: Sequence[Any], cache: ImageCache | dict | None = None) -> Images:
    """The :class:`Images` of pictures (bytes, paths or PIL images). ``cache`` (optional) keeps them by their
    bytes (pictures given as bytes only)."""
    key = tuple(images) if cache is not None and all(isinstance(x, bytes) for x in images) else None
    imgs = cache.get(key) if key is not None else None  # type: ignore[union-attr]
    if imgs is None:
        out = image_processor(images=[load_image(x, where="image") for x in images], return_tensors="pt")
        imgs = Images.of(out["pixel_values"], out["image_grid_thw"])
        if key is not None:
            cache[key] = imgs  # type: ignore[index]
    return imgs


def expand_images(ids: Sequence[int], images: Images | None, pad_id: int, merge: int) -> list[int]:
    """``ids`` with each single ``<|image_pad|>`` (one per image, in order) repeated to its image's token
    count; raises ValueError when the pads and the images do not pair up."""
    counts = images.token_counts(merge) if images is not None else []
    pads = sum(1 for i in ids if i == pad_id)
    if pads != len(counts):
        raise ValueError(f"{pads} image placeholder(s) in the text, {len(counts)} image(s)")
    it = iter(counts)
    out: list[int] = []
    for i in ids:
        out.extend([pad_id] * next(it) if i == pad_id else [i])
    return out


@dataclass(frozen=True)
class ImageEncoder:
    """The image side of a vision-language tokenizer: pictures to :class:`Images`, placeholders to image
    tokens. What a multi-turn session needs to append a tool's pictures (:class:`miles.agent.session.Session`)."""

    image_processor: Any
    pad_id: int
    merge: int
    cache: ImageCache | dict | None = None

    @staticmethod
    def of(tokenizer: Any, image_processor: Any, cache: ImageCache | dict | None = None) -> ImageEncoder:
        return ImageEncoder(image_processor, image_token_ids(tokenizer)[1],
                            int(getattr(image_processor, "merge_size", 2)), cache)

    def images(self, pictures: Sequence[Any]) -> Images:
        return process_images(self.image_processor, pictures, self.cache)

    def expand(self, ids: Sequence[int], images: Images | None) -> list[int]:
        return expand_images(ids, images, self.pad_id, self.merge)


def encode_image_prompt(
    tokenizer: Any,
    image_processor: Any,
    text: str,
    images: Sequence[Any],
    chat_template: bool = True,
    cache: dict | None = None,
) -> tuple[tuple[int, ...], Images | None]:
    """Prompt ids (as one user turn) and their :class:`Images`.

    Each image becomes ``<|vision_start|>`` + ``<|image_pad|>`` x (merged patches) + ``<|vision_end|>``,
    before ``text``; or where ``text`` holds :data:`PLACEHOLDER` s, one per image, there (a prompt that
    renders earlier turns, e.g. a tool's picture in a warm-start example of a multi-turn session).
    ``cache`` (optional) keeps processed images by their bytes (images given as bytes only).
    """
    from miles.models.tokenizer import encode_prompt

    if not images:
        return tuple(encode_prompt(tokenizer, text, chat_template)), None
    content = text if PLACEHOLDER in text else PLACEHOLDER * len(images) + text
    imgs = process_images(image_processor, images, cache)
    ids = encode_prompt(tokenizer, content, chat_template)
    merge = int(getattr(image_processor, "merge_size", 2))
    return tuple(expand_images(ids, imgs, image_token_ids(tokenizer)[1], merge)), imgs


def sequence_positions(
    prompt: Sequence[int], response: Sequence[int], grid_thw: torch.Tensor | None, image_token_id: int, merge: int
) -> torch.Tensor:
    """mRoPE positions [3, P + R] of a prompt and its response ids.

    The images of ``grid_thw`` are the image-token runs in order, the prompt's first and then those of the
    response (pictures that tools returned in a multi-turn session). Image tokens after the last image are
    text (a policy that sampled the placeholder): every such token ``t`` sits at ``t + delta`` in all three
    streams, as the engine's decode steps put it.
    """
    return mrope_positions(list(prompt) + list(response), grid_thw, image_token_id, merge, runs_after_images="text")[0]


def mrope_positions(
    ids: Sequence[int], grid_thw: torch.Tensor | None, image_token_id: int, merge: int,
    runs_after_images: str = "error",
) -> tuple[torch.Tensor, int]:
    """Multimodal RoPE positions of one unpadded sequence: ``([3, T] int64, delta)``.

    Each maximal run of ``image_token_id`` is the next image of ``grid_thw``; a run whose length is not
    that image's merged patch count raises ValueError, and so does a run after the last image unless
    ``runs_after_images="text"`` (it is then text). Without images (``grid_thw`` None or empty):
    ``arange(T)`` three times, delta 0.
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
        grid = next(grids, None) if is_img[i] else None
        if is_img[i] and grid is None and runs_after_images != "text":
            raise ValueError("mrope_positions: more image-token runs than images in grid_thw")
        if grid is None:
            out[:, i:j] = torch.arange(cur, cur + j - i)
            cur += j - i
        else:
            gt, gh, gw = grid
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
