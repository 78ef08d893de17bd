"""A conversation kept as the exact token ids the engine saw (token in, token out).

A :class:`Session` starts from the prompt's ids and grows by two kinds of turns:

- :meth:`Session.add_policy`: the engine's response ids, appended as they are, with their
  log-probs and loss mask 1;
- :meth:`Session.add_messages`: environment, tool or user messages, rendered with the
  tokenizer's chat template and appended as ids with log-prob 0 and loss mask 0.

Ids once appended are never re-tokenized, so the trainer sees byte for byte what was sampled.
The ids of new messages are the chat template's *delta*: ``render(messages + new)`` minus the
text the session's ids already cover, tokenized as it would be after that text (behind its last
special token, so a SentencePiece tokenizer adds no leading ``▁`` of its own). That text is
``render(messages)`` for the part the template renders, and the closing the template puts after an assistant turn (``"\\n"`` after
``<|im_end|>`` in ChatML) is appended as part of the next delta.

Template drift: the ids a session holds can differ from what tokenizing the rendered conversation
gives, when the policy sampled a non-canonical tokenization of its text (``"a" "b"`` where the
tokenizer merges ``"ab"``), when the template rewrites past turns (Qwen3 drops the ``<think>``
part of earlier assistant turns), or when a delta's tokens merge across the turn boundary.
:meth:`Session.drift` compares the two and reports the first differing token; with
``strict=True`` :meth:`Session.finish` raises :class:`TemplateDriftError` instead of returning.
The session's ids stay what the engine saw either way; drift means a chat-template consumer
(a server, an eval with ``apply_chat_template``) would feed the model different tokens.

Turns off the record: when a conversation can no longer be continued from the session's ids (the
template rewrote an earlier turn, or a client sent back text other than what was generated), a
server still answers it, from a fresh rendering of the conversation as sent
(:meth:`Session.render_ids`), and :meth:`Session.add_unrecorded` keeps that turn's text but not its
ids: its context is not the record, so it is never trained on. The record (``ids``, ``logprobs``,
``loss_mask``) then ends at the last turn generated from it; ``masked_turns`` counts the rest and
``off_record`` says why the first one left it.

Pictures (a vision-language model): with an :class:`~miles.models.vision.ImageEncoder`, the prompt's
and each environment turn's messages may hold image placeholders (:data:`miles.models.vision.PLACEHOLDER`),
one per picture given with them. Their ids get each placeholder expanded to the image's tokens, and
``images`` holds every picture of the conversation in order (what an engine request and a train row
carry). Image tokens are environment tokens: loss mask 0. Drift is checked on the expanded ids.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles.types import GenerateResult, Status

if TYPE_CHECKING:
    from miles.models.vision import ImageEncoder, Images


class TemplateDriftError(ValueError):
    """The chat template renders the conversation to other ids than the session holds."""


@dataclass(frozen=True, kw_only=True)
class Drift:
    """Where the session's ids and the re-rendered conversation's ids first differ."""

    position: int
    """Index (in the full conversation, prompt included) of the first differing token."""
    turn: int
    """Which turn holds that token (0: the prompt, then one per appended turn)."""
    session_ids: tuple[int, ...]
    """Up to 8 ids of the session from ``position`` on."""
    rendered_ids: tuple[int, ...]
    """Up to 8 ids of the rendered conversation from ``position`` on."""

    def describe(self, tokenizer: Any) -> str:
        """One readable line: the turn, the position and both token spans decoded."""
        ours = tokenizer.convert_ids_to_tokens(list(self.session_ids))
        theirs = tokenizer.convert_ids_to_tokens(list(self.rendered_ids))
        return (f"turn {self.turn}, token {self.position}: the session holds {ours} but the chat template "
                f"renders {theirs}")


class Session:
    """The token ids of one conversation, turn by turn; see the module docstring.

    ``messages`` are the chat messages the prompt ids were rendered from (``[{"role": "user",
    "content": ...}]``); ``render_kwargs`` go to every ``apply_chat_template`` call (e.g. ``tools``);
    ``pictures``: the prompt's pictures, one per placeholder in ``messages``, with ``encoder`` (needed
    for any picture, here or in :meth:`add_messages`).
    """

    def __init__(
        self, tokenizer: Any, messages: Sequence[Mapping[str, str]], *, strict: bool = False,
        render_kwargs: Mapping[str, Any] | None = None, pictures: Sequence[Any] = (),
        encoder: ImageEncoder | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.strict = strict
        self.render_kwargs = dict(render_kwargs or {})
        self.encoder = encoder
        self.images: Images | None = self._pictures(pictures)
        self.messages: list[dict[str, str]] = [dict(m) for m in messages]
        self._covered = self._render(self.messages, generation_prompt=True)  # text the ids stand for
        self.prompt_ids: list[int] = self._expand(self._ids(self._covered), self.images)
        self.response_ids: list[int] = []
        self.logprobs: list[float] = []
        self.loss_mask: list[int] = []
        self.turn_starts: list[int] = []  # offset in response_ids where each appended turn begins
        self.status = Status.COMPLETED
        self.weight_version = -1
        self.policy_turns = 0
        self.policy_messages: list[int] = []  # the index in ``messages`` of each policy turn's text
        self.masked_turns = 0  # policy turns served off the record (add_unrecorded)
        self.off_record: str | None = None  # why the first of them could not continue the record

    # ---- appending ----------------------------------------------------------------------------

    @property
    def ids(self) -> list[int]:
        """The whole conversation: prompt ids then every appended turn's ids."""
        return self.prompt_ids + self.response_ids

    def add_policy(self, result: GenerateResult) -> str:
        """Append one engine response (ids, log-probs, loss mask 1); returns its text (special
        tokens skipped). The response's status becomes the session's status; the session's
        ``weight_version`` is the oldest of its turns' (what bounds its staleness)."""
        assert len(result.response_ids) == len(result.logprobs), "engine result with mismatched log-probs"
        self.turn_starts.append(len(self.response_ids))
        self.response_ids += result.response_ids
        self.logprobs += result.logprobs
        self.loss_mask += [1] * len(result.response_ids)
        self.status = result.status
        self.weight_version = (result.weight_version if self.policy_turns == 0
                               else min(self.weight_version, result.weight_version))
        self.policy_turns += 1
        text = self.tokenizer.decode(list(result.response_ids), skip_special_tokens=True)
        raw = self.tokenizer.decode(list(result.response_ids), skip_special_tokens=False)
        self.policy_messages.append(len(self.messages))
        self.messages.append({"role": "assistant", "content": text})
        self._covered += raw
        return text

    def add_messages(self, messages: Sequence[Mapping[str, str]], pictures: Sequence[Any] = ()) -> list[int]:
        """Append environment messages (and the assistant header after them) as ids with loss mask 0;
        ``pictures``: one per image placeholder in ``messages``, in order.

        Returns the appended ids. Raises :class:`TemplateDriftError` when the rendered conversation
        does not start with the text the session already covers (the template rewrote an earlier
        turn), since no delta then exists, and ValueError when the placeholders and ``pictures`` do not
        pair up; nothing is appended then.
        """
        new_images = self._pictures(pictures)
        extended = self.messages + [dict(m) for m in messages]
        rendered = self._render(extended, generation_prompt=True)
        if not rendered.startswith(self._covered):
            at = next((i for i, (a, b) in enumerate(zip(rendered, self._covered, strict=False)) if a != b),
                      min(len(rendered), len(self._covered)))
            raise TemplateDriftError(
                f"the chat template rewrote an earlier turn: at character {at} the session holds "
                f"{self._covered[at:at + 40]!r} but the template renders {rendered[at:at + 40]!r}; "
                "ids cannot be appended without re-tokenizing (use a template that keeps past turns as "
                "they were generated)")
        delta = self._expand(self._delta_ids(rendered[len(self._covered):]), new_images)
        self.messages = extended
        self._covered_before_messages, self._images_before_messages = self._covered, self.images
        if new_images is not None:
            self.images = new_images if self.images is None else self.images + new_images
        self.turn_starts.append(len(self.response_ids))
        self.response_ids += delta
        self.logprobs += [0.0] * len(delta)
        self.loss_mask += [0] * len(delta)
        self._covered = rendered
        return delta

    def add_unrecorded(self, messages: Sequence[Mapping[str, str]], result: GenerateResult, reason: str) -> str:
        """A policy turn generated from :meth:`render_ids` of ``messages`` (the conversation as a client sent
        it) instead of from the session's ids; returns its text. ``messages`` and the reply become the
        session's messages; the ids, log-probs and loss mask stay as they were (the record), since this
        turn's context is not theirs. The first such turn's ``reason`` is kept in ``off_record``."""
        text = self.tokenizer.decode(list(result.response_ids), skip_special_tokens=True)
        self.messages = [dict(m) for m in messages] + [{"role": "assistant", "content": text}]
        self.policy_messages = [k for k, m in enumerate(self.messages) if m["role"] == "assistant"]
        self.masked_turns += 1
        self.off_record = self.off_record or reason
        return text

    def render_ids(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """The ids of ``messages`` rendered afresh with the chat template and the assistant header."""
        return self._ids(self._render([dict(m) for m in messages], generation_prompt=True))

    def drop_last_turn(self) -> None:
        """Remove the last appended turn if it was :meth:`add_messages`' (e.g. it left no room for
        another policy turn); the session is then as it was before that call."""
        assert self.turn_starts and self.loss_mask[self.turn_starts[-1]:] and not any(
            self.loss_mask[self.turn_starts[-1]:]), "the last turn is not an environment turn"
        start = self.turn_starts.pop()
        del self.response_ids[start:], self.logprobs[start:], self.loss_mask[start:]
        while self.messages[-1]["role"] != "assistant":
            self.messages.pop()
        self._covered, self.images = self._covered_before_messages, self._images_before_messages

    # ---- drift -------------------------------------------------------------------------------

    def drift(self) -> Drift | None:
        """The first difference between the session's ids and the tokenized chat-template rendering
        of its messages (with the assistant header when the last turn is not the policy's), or None."""
        last_is_policy = bool(self.messages) and self.messages[-1]["role"] == "assistant"
        rendered = self._render(self.messages, generation_prompt=not last_is_policy)
        expected, ours = self._ids(rendered), self.ids
        try:
            expected = self._expand(expected, self.images)
        except ValueError:  # the rendering lost or gained a placeholder: the difference is reported below
            pass
        if last_is_policy:  # the template closes the turn after what the model generated
            expected = expected[:len(ours)] if expected[:len(ours)] == ours else expected
        if expected == ours:
            return None
        pos = next((i for i, (a, b) in enumerate(zip(ours, expected, strict=False)) if a != b), min(len(ours), len(expected)))
        rel = pos - len(self.prompt_ids)
        turn = 0 if rel < 0 else sum(1 for s in self.turn_starts if s <= rel)
        return Drift(position=pos, turn=turn, session_ids=tuple(ours[pos:pos + 8]),
                     rendered_ids=tuple(expected[pos:pos + 8]))

    def finish(self) -> Drift | None:
        """Check drift once the conversation is over; raises :class:`TemplateDriftError` in strict mode."""
        found = self.drift()
        if found is not None and self.strict:
            raise TemplateDriftError(f"template drift: {found.describe(self.tokenizer)} (strict mode)")
        return found

    # ---- helpers -----------------------------------------------------------------------------

    def _render(self, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **self.render_kwargs)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _pictures(self, pictures: Sequence[Any]) -> Images | None:
        if not pictures:
            return None
        if self.encoder is None:
            raise ValueError(f"{len(pictures)} picture(s) for a session without an image encoder (a text-only "
                             "model cannot see them; use a vision-language model, e.g. model=qwen_vl)")
        return self.encoder.images(pictures)

    def _expand(self, ids: list[int], images: Images | None) -> list[int]:
        """``ids`` with their image placeholders expanded to ``images``' tokens (unchanged without an encoder)."""
        return ids if self.encoder is None else self.encoder.expand(ids, images)

    def _delta_ids(self, text: str) -> list[int]:
        """``text``'s ids as they tokenize after the covered text: encoded behind the covered text's tail
        from its last special token on, whose ids are then dropped. A tokenizer that marks the start of
        a text (SentencePiece's leading ``▁``) would otherwise give the delta a token the conversation
        tokenized whole does not have."""
        specials = [t for t in self.tokenizer.all_special_tokens if t]
        start = max((self._covered.rfind(t) for t in specials), default=-1)
        if start >= 0:
            head = self._ids(self._covered[start:])
            both = self._ids(self._covered[start:] + text)
            if both[:len(head)] == head:
                return both[len(head):]
        return self._ids(text)
