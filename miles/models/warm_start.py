"""Supervised fine-tuning: the loss, and the short warm start that gives a tiny model partial skill.

RL from a random init barely moves on CPU (GRPO stalled at 20-40% after 1,500
steps on toy arithmetic, FACTS.md): a policy that never samples a correct
answer gets no signal. A short supervised warm start on the task's own
(prompt, answer) pairs fixes that. It is kept deliberately short so that the
model ends *partly* skilled and RL has headroom to show.

Each example is the chat-formatted prompt (exactly the ids a rollout engine is
fed, :func:`miles.models.tokenizer.encode_prompt`) followed by the answer and
the end-of-turn token; only the answer and end-of-turn tokens are trained on.
"""

from __future__ import annotations

import logging
import random

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from miles.algos.microbatches import count_microbatches, split_microbatches
from miles.models.tokenizer import encode_prompt

log = logging.getLogger(__name__)

IGNORE_INDEX = -100


def sft_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Mean next-token cross-entropy over labelled tokens.

    logits: [B, T, V] predicting position t+1 from position t; labels: [B, T] int64 with ``-100``
    where nothing is learned. The loss at position t compares ``logits[:, t]`` with ``labels[:, t + 1]``
    and is averaged over all labelled (shifted) tokens of the batch -> scalar fp32 (``reduction="sum"``:
    summed instead).
    """
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    return F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1), ignore_index=IGNORE_INDEX,
        reduction=reduction,
    )


def sft_ids(tokenizer: PreTrainedTokenizerBase, prompt: str, response: str,
            chat_template: bool = True) -> tuple[list[int], list[int]]:
    """One example's ``(prompt_ids, response_ids)``: the prompt as a rollout engine is fed it, the response and
    the end-of-turn token."""
    return (encode_prompt(tokenizer, prompt, chat_template),
            tokenizer.encode(response, add_special_tokens=False) + [tokenizer.eos_token_id])


def collate_sft(
    tokenizer: PreTrainedTokenizerBase, examples: list[tuple[str, str]], chat_template: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``(input_ids [B, T], attention_mask [B, T], labels [B, T])`` for (prompt, response) pairs.

    Labels are ``-100`` on prompt and padding tokens, the token id on the response and its final eos.
    """
    rows: list[tuple[list[int], int]] = []
    for prompt, response in examples:
        prompt_ids, response_ids = sft_ids(tokenizer, prompt, response, chat_template)
        rows.append((prompt_ids + response_ids, len(prompt_ids)))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for i, (ids, n_prompt) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention_mask[i, : len(ids)] = 1
        labels[i, n_prompt : len(ids)] = torch.tensor(ids[n_prompt:])
    return input_ids, attention_mask, labels


def warm_start(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, task, *, steps: int,
               batch_size: int, lr: float, seed: int, max_tokens_per_microbatch: int = 0) -> dict[str, float]:
    """Train ``model`` in place for ``steps`` AdamW steps on ``task.sft_examples``; deterministic under ``seed``.

    ``task`` needs ``sft_examples(n, rng) -> list[(prompt, response)]``. The learning rate warms up
    linearly over the first 10% of steps and decays linearly to 10% of ``lr``. Returns
    ``{"sft/loss_first", "sft/loss_last", "sft/steps"}`` (``loss_last`` averages the final 10% of steps).

    A batch whose padded size is over ``max_tokens_per_microbatch`` (0: no limit) is sorted by length and
    split into passes of at most that many padded tokens (:func:`miles.algos.microbatches.split_microbatches`);
    each pass's summed loss over the batch's labelled-token count accumulates into the same gradient.
    On answers of widely varied length this halves the work (a 19M model on ``count``: 6.2 -> 3.5 s
    per batch of 32). A batch within the budget takes one pass, exactly as without the option.
    """
    if steps <= 0:
        return {"sft/steps": 0.0}
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, 1.0 - 0.9 * s / steps)
    )
    losses: list[float] = []
    log_every = max(1, steps // 4)
    for step in range(steps):
        examples = task.sft_examples(batch_size, rng)
        optimizer.zero_grad(set_to_none=True)
        loss = _accumulate(model, tokenizer, examples, getattr(task, "chat_template", True), max_tokens_per_microbatch)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss)
        if (step + 1) % log_every == 0 or step + 1 == steps:
            log.info("warm start step %d/%d: loss %.4f", step + 1, steps, losses[-1])
    model.eval()
    tail = losses[-max(1, steps // 10):]
    return {"sft/loss_first": losses[0], "sft/loss_last": sum(tail) / len(tail), "sft/steps": float(steps)}


def _accumulate(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, examples: list[tuple[str, str]],
                chat_template: bool, max_tokens: int) -> float:
    """Backward of the batch's mean SFT loss, in passes of at most ``max_tokens`` padded tokens; returns the loss."""
    input_ids, attention_mask, labels = collate_sft(tokenizer, examples, chat_template)
    if max_tokens <= 0 or input_ids.numel() <= max_tokens:
        loss = sft_loss(model(input_ids=input_ids, attention_mask=attention_mask).logits, labels)
        loss.backward()
        return loss.item()
    lengths = attention_mask.sum(-1).tolist()
    total = int((labels[:, 1:] != IGNORE_INDEX).sum())  # labelled (shifted) tokens of the whole batch
    loss_sum = 0.0
    for group in split_microbatches(lengths, max_tokens, count_microbatches(lengths, max_tokens)):
        rows, width = torch.tensor(group), max(lengths[i] for i in group)  # right-padded: trim to the group's longest
        ids, mask, lab = (t[rows, :width] for t in (input_ids, attention_mask, labels))
        part = sft_loss(model(input_ids=ids, attention_mask=mask).logits, lab, reduction="sum") / total
        part.backward()
        loss_sum += part.item()
    return loss_sum
