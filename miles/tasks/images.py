"""Image tasks drawn offline with Pillow: count the shapes of one colour, say which of two bars is taller.

Each problem is a :class:`ImageProblem`: the question, the exact answer and the picture as PNG bytes
(drawn from the problem key alone, so the same key is the same picture in every process). The held-out
split is the hashed key split of :mod:`miles.tasks.procedural`: no training picture is an evaluation
picture. Rewards are exact answers (:func:`miles.tasks.procedural.exact_answer_reward`).

- :class:`ShapeCountTask`: 1 to ``max_shapes`` circles and squares in red, green or blue on the cells
  of a 3x3 grid; "How many red shapes?" -> ``"2"``.
- :class:`BarsTask`: two grey bars of different heights; "Which bar is taller?" -> ``"left"``/``"right"``.
"""

from __future__ import annotations

import io
import random
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from miles.tasks.procedural import ProceduralTask, exact_answer_reward

__all__ = ["BarsTask", "ImageProblem", "ShapeCountTask", "exact_answer_reward"]

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 30), "blue": (30, 60, 220)}


@dataclass(frozen=True)
class ImageProblem:
    """A question about one or more pictures (PNG bytes), its exact answer."""

    prompt: str
    label: Any
    images: tuple[bytes, ...] = ()


def _png(img: Any) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


class _ImageTask(ProceduralTask):
    size: int

    def sample(self, n: int, rng: random.Random) -> list[ImageProblem]:  # type: ignore[override]
        """As :meth:`ProceduralTask.sample`; each key's picture is drawn once (kept by key)."""
        cache = self.__dict__.setdefault("_drawn", {})
        out: list[ImageProblem] = []
        while len(out) < n:
            key = self.draw(rng)
            if not self.is_heldout_key(key):
                if key not in cache:
                    cache[key] = self.problem(key)
                out.append(cache[key])
        return out

    def canvas(self) -> tuple[Any, Any]:
        from PIL import Image, ImageDraw

        img = Image.new("RGB", (self.size, self.size), (255, 255, 255))
        return img, ImageDraw.Draw(img)

    def corpus(self) -> list[str]:
        problems = self.sample(200, random.Random(0))
        return [p.prompt for p in problems] + [str(p.label) for p in problems] + ["0123456789"]

    def sft_examples(self, n: int, rng: random.Random) -> list[tuple[str, str, tuple[bytes, ...]]]:
        """``n`` (prompt, target response, images) triples from the training split."""
        return [(p.prompt, str(p.label), p.images) for p in self.sample(n, rng)]


class ShapeCountTask(_ImageTask):
    """Count the shapes of ``colour`` among 1..``max_shapes`` coloured circles and squares."""

    def __init__(
        self,
        *,
        colour: str = "red",
        max_shapes: int = 5,
        size: int = 112,
        heldout_fraction: float = 0.1,
        eval_seed: int = 12345,
    ) -> None:
        super().__init__(heldout_fraction=heldout_fraction, eval_seed=eval_seed)
        if colour not in COLOURS:
            raise ValueError(f"colour: one of {', '.join(COLOURS)}, found {colour!r}")
        if not 1 <= max_shapes <= 9:
            raise ValueError(
                f"max_shapes: must be in [1, 9] (one shape per cell of a 3x3 grid), found {max_shapes}"
            )
        if size < 28:
            raise ValueError(f"size: at least 28 pixels, found {size}")
        self.colour, self.max_shapes, self.size = colour, max_shapes, size

    def draw(self, rng: random.Random) -> tuple[tuple[int, int, int], ...]:
        cells = sorted(rng.sample(range(9), rng.randint(1, self.max_shapes)))
        return tuple((c, rng.randrange(2), rng.randrange(len(COLOURS))) for c in cells)

    def key_text(self, key: Hashable) -> str:
        return ";".join(f"{c},{k},{col}" for c, k, col in key)  # type: ignore[attr-defined]

    def problem(self, key: Any) -> ImageProblem:
        img, d = self.canvas()
        cell, names = self.size / 3, list(COLOURS)
        r = cell * 0.32
        for c, kind, col in key:
            cx, cy = (c % 3 + 0.5) * cell, (c // 3 + 0.5) * cell
            box = (cx - r, cy - r, cx + r, cy + r)
            (d.ellipse if kind == 0 else d.rectangle)(box, fill=COLOURS[names[col]])
        count = sum(names[col] == self.colour for _, _, col in key)
        return ImageProblem(prompt=f"How many {self.colour} shapes?", label=str(count), images=(_png(img),))


class BarsTask(_ImageTask):
    """Two bars of heights in [``min_height``, 100]% of the picture; which is taller, left or right."""

    def __init__(
        self, *, min_height: int = 10, size: int = 112, heldout_fraction: float = 0.1, eval_seed: int = 12345
    ) -> None:
        super().__init__(heldout_fraction=heldout_fraction, eval_seed=eval_seed)
        if not 1 <= min_height < 100:
            raise ValueError(f"min_height: must be in [1, 100), found {min_height}")
        self.min_height, self.size = min_height, size

    def draw(self, rng: random.Random) -> tuple[int, int]:
        a, b = rng.sample(range(self.min_height, 101), 2)
        return a, b

    def key_text(self, key: Any) -> str:
        return f"{key[0]},{key[1]}"

    def problem(self, key: Any) -> ImageProblem:
        img, d = self.canvas()
        s = self.size
        for i, h in enumerate(key):
            x0 = s * (0.15 + 0.45 * i)
            d.rectangle((x0, s * (1 - h / 100), x0 + s * 0.3, s - 1), fill=(90, 90, 90))
        return ImageProblem(
            prompt="Which bar is taller, left or right?",
            label="left" if key[0] > key[1] else "right",
            images=(_png(img),),
        )
