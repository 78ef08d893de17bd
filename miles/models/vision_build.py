"""Build a tiny vision-language checkpoint offline: tokenizer, image processor, model, warm start.

The tokenizer is the task-trained BPE of :mod:`miles.models.tokenizer` plus the three vision tokens
(:data:`miles.models.vision.VISION_TOKENS`); the image processor is Qwen2-VL's (resizing into
:data:`miles.models.qwen_vl.IMAGE_PIXELS`, 14-pixel patches, 2x2 merge), saved with the checkpoint as
``preprocessor_config.json``. The warm start is :func:`miles.models.warm_start.warm_start`'s recipe on
``(prompt, response, images)`` examples: the loss is on the answer and its end-of-turn token only.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from miles.models.vision import (
    VISION_TOKENS,
    Images,
    cat_images,
    encode_image_prompt,
    image_token_ids,
    mrope_positions,
)

IGNORE_INDEX = -100


def image_processor(min_pixels: int, max_pixels: int) -> Any:
    """Qwen2-VL's image processor (its Pillow backend: no torchvision needed)."""
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

    return pil.Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)


def load_image_processor(checkpoint_dir: str | Path) -> Any:
    """The image processor saved with a vision-language checkpoint."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(str(checkpoint_dir))


def vision_config(spec_config: Any, tokenizer: Any) -> Any:
    """``spec_config`` with the tokenizer's vocabulary size and special / vision token ids."""
    config = copy.deepcopy(spec_config)
    start, pad, end = image_token_ids(tokenizer)
    config.text_config.vocab_size = len(tokenizer)
    for c in (config, config.text_config):
        c.eos_token_id, c.pad_token_id, c.bos_token_id = (
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
            tokenizer.pad_token_id,
        )
    config.image_token_id, config.vision_start_token_id, config.vision_end_token_id = pad, start, end
    config.video_token_id = pad  # no videos: never met apart from images
    return config


def collate_vision_sft(
    tokenizer: Any,
    processor: Any,
    examples: Sequence[tuple],
    image_token_id: int,
    merge: int,
    cache: dict | None = None,
) -> dict[str, torch.Tensor]:
    """Right-padded model inputs and labels for ``(prompt, response[, images])`` examples.

    Returns ``input_ids, attention_mask, position_ids [3, B, T], labels`` and, when any example has
    images, ``pixel_values`` and ``image_grid_thw`` (rows' images in row order).
    """
    rows, imgs = [], []
    for ex in examples:
        prompt, response, images = (*ex, ())[:3]
        ids, im = encode_image_prompt(tokenizer, processor, prompt, images, cache=cache)
        resp = tokenizer.encode(response, add_special_tokens=False) + [tokenizer.eos_token_id]
        rows.append((list(ids) + resp, len(ids)))
        imgs.append(im)
    width = max(len(ids) for ids, _ in rows)
    b = len(rows)
    out = {
        "input_ids": torch.full((b, width), tokenizer.pad_token_id, dtype=torch.long),
        "attention_mask": torch.zeros((b, width), dtype=torch.long),
        "position_ids": torch.zeros((3, b, width), dtype=torch.long),
        "labels": torch.full((b, width), IGNORE_INDEX, dtype=torch.long),
    }
    for i, ((ids, n_prompt), im) in enumerate(zip(rows, imgs, strict=True)):
        out["input_ids"][i, : len(ids)] = torch.tensor(ids)
        out["attention_mask"][i, : len(ids)] = 1
        out["labels"][i, n_prompt : len(ids)] = torch.tensor(ids[n_prompt:])
        out["position_ids"][:, i, : len(ids)] = mrope_positions(
            ids, None if im is None else im.grid_thw, image_token_id, merge
        )[0]
    pixels = cat_images(imgs)
    if pixels is not None:
        out["pixel_values"], out["image_grid_thw"] = pixels
    return out


def build_vision_checkpoint(run: Any, spec: Any, task: Any, out: Path, tokenizer: Any) -> dict[str, float]:
    """Model, image processor and warm start of a vision-language spec, saved into ``out``."""
    from transformers import AutoModelForImageTextToText, GenerationConfig

    from miles.models.qwen_vl import IMAGE_PIXELS
    from miles.models.warm_start import sft_loss

    tokenizer.add_tokens(list(VISION_TOKENS), special_tokens=True)
    processor = image_processor(*IMAGE_PIXELS)
    config = vision_config(spec.hf_config, tokenizer)
    torch.manual_seed(run.seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    ws = run.warm_start
    metrics: dict[str, float] = {"sft/steps": float(ws.steps)}
    if ws.steps > 0:
        rng = random.Random(run.seed)
        merge = int(config.vision_config.spatial_merge_size)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=ws.lr, betas=(0.9, 0.99), weight_decay=0.0)
        warmup = max(1, ws.steps // 10)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min((s + 1) / warmup, 1.0 - 0.9 * s / ws.steps)
        )
        losses, cache = [], {}
        for _ in range(ws.steps):
            batch = collate_vision_sft(
                tokenizer,
                processor,
                task.sft_examples(ws.batch_size, rng),
                config.image_token_id,
                merge,
                cache,
            )
            labels = batch.pop("labels")
            opt.zero_grad(set_to_none=True)
            loss = sft_loss(model(**batch, use_cache=False).logits, labels)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
        model.eval()
        tail = losses[-max(1, ws.steps // 10) :]
        metrics.update({"sft/loss_first": losses[0], "sft/loss_last": sum(tail) / len(tail)})
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    processor.save_pretrained(out)
    return metrics


__all__ = ["Images", "build_vision_checkpoint", "collate_vision_sft", "load_image_processor", "vision_config"]
