"""A tool that returns pictures, and image tasks whose picture only that tool shows.

The policy of a vision-language model sees the question without its picture and has to call ``view``::

    <|im_start|>user
    Use the view tool to see the picture. Which bar is taller, left or right?<|im_end|>
    <|im_start|>assistant
    <tool_call>{"name": "view", "arguments": {}}</tool_call><|im_end|>
    <|im_start|>user
    <tool_response>
    <|vision_start|><|image_pad|> x 16<|vision_end|>
    </tool_response><|im_end|>
    <|im_start|>assistant
    left<|im_end|>

The picture's tokens are environment tokens (loss mask 0), kept token-exact in the session with the
picture's pixels (:class:`miles.agent.session.Session`); the trainer computes the same positions and
features for them as the engine did.

- :class:`View`: tool ``view(part)``, bound to one problem's pictures by :meth:`View.for_problem` (the
  tool loop binds it per prompt); ``part`` is ``all`` (the default) or a half (``left``, ``right``,
  ``top``, ``bottom``) scaled back to the picture's size.
- :class:`ViewTask`: an image task of :mod:`miles.tasks.images` (``kind``: ``bars`` or ``shapes``)
  whose prompts hold no picture; its warm start teaches the call (first turn) and the answer after
  the tool's picture (second turn, ``second_turn_fraction`` of the examples), like
  :class:`miles.agent.tasks.CalculatorArithmeticTask`.
"""

from __future__ import annotations

import io
import json
import random
from dataclasses import dataclass
from typing import Any

from miles.agent.tools import Observation
from miles.models.tokenizer import IM_END, IM_START
from miles.tasks.images import BarsTask, ShapeCountTask, exact_answer_reward

__all__ = ["PictureProblem", "View", "ViewTask", "exact_answer_reward"]

PARTS = ("all", "left", "right", "top", "bottom")


@dataclass(frozen=True)
class PictureProblem:
    """A question whose pictures (PNG bytes) are not in the prompt: a tool shows them."""

    prompt: str
    label: Any
    pictures: tuple[bytes, ...] = ()


class View:
    """Tool ``view(part="all")``: the problem's picture(s), or one half of each scaled to the full size."""

    name = "view"
    description = "Show the picture the question is about (part: all, left, right, top or bottom half)."
    parameters = {"type": "object", "properties": {"part": {"type": "string", "enum": list(PARTS)}}}

    def __init__(self, *, timeout_s: float = 2.0, pictures: tuple[bytes, ...] = ()) -> None:
        self.timeout_s = timeout_s
        self.pictures = tuple(pictures)

    def for_problem(self, problem: Any) -> View:
        """This tool, showing ``problem``'s pictures (``pictures``, else ``images``)."""
        pictures = getattr(problem, "pictures", None) or getattr(problem, "images", None) or ()
        return View(timeout_s=self.timeout_s, pictures=tuple(pictures))

    def __call__(self, arguments: dict[str, Any]) -> Observation:
        part = arguments.get("part", "all")
        if part not in PARTS:
            raise ValueError(f'"part" must be one of {", ".join(PARTS)}, found {part!r}')
        if not self.pictures:
            raise ValueError("there is no picture for this question")
        return Observation(images=tuple(self.pictures if part == "all" else (_half(p, part) for p in self.pictures)))


def _half(png: bytes, part: str) -> bytes:
    from PIL import Image

    img = Image.open(io.BytesIO(png)).convert("RGB")
    w, h = img.size
    box = {"left": (0, 0, w // 2, h), "right": (w - w // 2, 0, w, h), "top": (0, 0, w, h // 2),
           "bottom": (0, h - h // 2, w, h)}[part]
    buf = io.BytesIO()
    img.crop(box).resize((w, h)).save(buf, format="PNG")
    return buf.getvalue()


CALL = '<tool_call>{"name": "view", "arguments": {}}</tool_call>'
"""The call the warm start teaches (the canonical JSON of :func:`json.dumps`)."""


class ViewTask:
    """The questions of an image task (``kind``: ``bars`` or ``shapes``, with that task's arguments) with
    their pictures behind the ``view`` tool; held-out split, labels and rewards are the inner task's."""

    needs_vision = True
    """The pictures reach the policy only through a tool, so the task itself asks for a vision-language model."""

    def __init__(self, *, kind: str = "bars", second_turn_fraction: float = 0.5, **kwargs: Any) -> None:
        inner = {"bars": BarsTask, "shapes": ShapeCountTask}
        if kind not in inner:
            raise ValueError(f"kind: one of {', '.join(inner)}, found {kind!r}")
        if not 0.0 <= second_turn_fraction <= 1.0:
            raise ValueError(f"second_turn_fraction: must be in [0, 1], found {second_turn_fraction}")
        self.inner = inner[kind](**kwargs)
        self.second_turn_fraction = second_turn_fraction

    def _hide(self, p: Any) -> PictureProblem:
        return PictureProblem(prompt=f"Use the view tool to see the picture. {p.prompt}", label=p.label,
                              pictures=p.images)

    def sample(self, n: int, rng: random.Random) -> list[PictureProblem]:
        return [self._hide(p) for p in self.inner.sample(n, rng)]

    def eval_problems(self, n: int) -> list[PictureProblem]:
        return [self._hide(p) for p in self.inner.eval_problems(n)]

    def reference_response(self, problem: PictureProblem) -> str:
        return CALL

    def sft_examples(self, n: int, rng: random.Random) -> list[tuple[str, str, tuple[bytes, ...]]]:
        """``n`` (prompt, response, pictures) triples: first turns (the call, no picture) and second turns
        (the answer after the tool's picture, rendered as the session renders it)."""
        from miles.agent.tools import ToolOutcome, tool_response_message

        out = []
        for p in self.sample(n, rng):
            if rng.random() < self.second_turn_fraction:
                reply = tool_response_message([ToolOutcome(name="view", text="", images=p.pictures)])["content"]
                out.append((f"{p.prompt}{IM_END}\n{IM_START}assistant\n{CALL}{IM_END}\n{IM_START}user\n{reply}",
                            str(p.label), p.pictures))
            else:
                out.append((p.prompt, CALL, ()))
        return out

    def corpus(self) -> list[str]:
        problems = self.sample(200, random.Random(0))
        return self.inner.corpus() + [p.prompt for p in problems] + [CALL] * 200 + [
            "<tool_response>\n\n</tool_response>", json.dumps({"part": "left"})]
