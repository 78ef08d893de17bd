"""Images in the torch engine's prefill: request checks, image features at the image tokens, mRoPE
positions; a base of :class:`~miles.rollout.torch_engine.TorchEngine` (vision-language checkpoints)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from miles.rollout.engine_rows import _Row
from miles.types import GenerateRequest


class EngineVision:
    """Image prefill; the engine's constructor sets the attributes below (``vision``: the checkpoint is a
    vision-language model)."""

    vision: bool
    model: Any
    checkpoint_dir: str
    device: torch.device
    dtype: torch.dtype
    _base: Any
    _image_token: int
    _merge: int

    def _check_images(self, r: GenerateRequest) -> None:
        """A request's images fit its prompt: one placeholder run per image, of the image's token count."""
        if r.images is None:
            if self.vision and self._image_token in r.prompt_ids:
                raise ValueError(f"request {r.request_id!r}: its prompt holds image tokens but it carries no images")
            return
        if not self.vision:
            raise ValueError(f"request {r.request_id!r} carries images, but {self.checkpoint_dir} is a text-only "
                             f"{self.model.config.model_type!r} model")
        from miles.models.vision import mrope_positions

        try:
            mrope_positions(r.prompt_ids, r.images.grid_thw, self._image_token, self._merge)
        except ValueError as e:
            raise ValueError(f"request {r.request_id!r}: {e}") from None
        runs = sum(1 for i, t in enumerate(r.prompt_ids)
                   if t == self._image_token and (i == 0 or r.prompt_ids[i - 1] != t))
        if runs != len(r.images):
            raise ValueError(f"request {r.request_id!r}: {runs} image-token runs in the prompt, {len(r.images)} images")

    def _vision_inputs(self, groups: list[list[_Row]], start: list[int], lens: list[int], ids: Tensor
                       ) -> tuple[Tensor, Tensor, Tensor]:
        """Input embeddings [u, t, D] (image features at the image tokens), mRoPE positions [3, u, t] and
        each prompt's position delta [u] for the prefill of ``groups``' prompts from ``start``."""
        from miles.models.vision import cat_images, mrope_positions

        u, t = ids.shape
        embeds = self._base.embed_tokens(ids)
        positions = torch.arange(t, device=self.device).expand(3, u, t).clone()
        deltas = torch.zeros(u, dtype=torch.long, device=self.device)
        reqs = [g[0].request for g in groups]
        pixels = cat_images([r.images for r in reqs])
        feats: list[Tensor] = []
        if pixels is not None:
            out = self.model.model.get_image_features(pixels[0].to(self.device, self.dtype), pixels[1].to(self.device))
            feats = list(out.pooler_output)  # per image [tokens, D]
        k = 0
        for i, r in enumerate(reqs):
            grid = r.images.grid_thw if r.images is not None else None
            pos, delta = mrope_positions(r.prompt_ids, grid, self._image_token, self._merge)
            positions[:, i, : lens[i]] = pos[:, start[i]: start[i] + lens[i]].to(self.device)
            deltas[i] = delta
            if grid is None:
                continue
            mine = torch.cat(feats[k: k + len(r.images)])
            k += len(r.images)
            before = sum(1 for x in r.prompt_ids[: start[i]] if x == self._image_token)  # in a reused prefix
            where = ids[i, : lens[i]] == self._image_token
            embeds[i, : lens[i]][where] = mine[before:].to(embeds.dtype)
        return embeds, positions, deltas
