"""On-policy distillation's per-token advantages (``algo=opd``, docs/distillation.md).

The policy ``p`` samples a response; a teacher ``q`` scores each of its tokens. The reverse KL of one
sequence, ``KL(p || q) = E_p[sum_t log p(y_t) - log q(y_t)]``, has the policy gradient of a per-token reward
``-(log p(y_t) - log q(y_t))`` with no credit passed between tokens (Agarwal et al. 2024, GKD; Lu and
Thinking Machines 2025, "On-Policy Distillation"). So each token's advantage is::

    A_t = task_reward_weight * A_task + distill_coef * (log q(y_t) - log p(y_t))

``A_task`` is the sample's advantage from its task reward (the group estimator, e.g. GRPO), ``log p`` the
policy's sampling log-prob of the token (``Sample.rollout_logprobs``), ``log q`` the teacher's at the same
temperature. Tokens outside the loss mask (tool output, the environment's turns) get 0; the loss ignores
them. The advantages go to the trainer as ``TrainBatch.token_advantages``, under the PPO-clip loss.

Pure list math, testable on its own.
"""

from __future__ import annotations

from collections.abc import Sequence


def opd_token_advantages(advantages: Sequence[float], rollout_logprobs: Sequence[Sequence[float]],
                         teacher_logprobs: Sequence[Sequence[float] | None], loss_mask: Sequence[Sequence[int]], *,
                         distill_coef: float, task_reward_weight: float) -> tuple[list[list[float]], dict[str, float]]:
    """Per response token advantages (the formula above) of every sample, and the step's metrics.

    ``teacher_logprobs[i]`` is None for a sample the teacher did not score (a failed one): its tokens get its
    task advantage alone, and its loss mask keeps it out of the loss anyway. Metrics, each a mean over the
    scored samples' loss-mask tokens: ``distill/reverse_kl`` (``log p - log q``, the per-token estimate of
    ``KL(p || q)``), ``distill/teacher_logprob``, ``distill/policy_logprob``; and ``distill/scored_samples``.
    """
    if not len(advantages) == len(rollout_logprobs) == len(teacher_logprobs) == len(loss_mask):
        raise ValueError(f"opd_token_advantages: {len(advantages)} advantages, {len(rollout_logprobs)} rollout "
                         f"log-prob rows, {len(teacher_logprobs)} teacher rows, {len(loss_mask)} loss masks")
    out: list[list[float]] = []
    kl = lq = lp = 0.0
    tokens = scored = 0
    for i, (a, p_row, q_row, mask) in enumerate(zip(advantages, rollout_logprobs, teacher_logprobs, loss_mask,
                                                    strict=True)):
        base = task_reward_weight * a
        if q_row is None:
            out.append([base if m else 0.0 for m in mask])
            continue
        if not len(p_row) == len(q_row) == len(mask):
            raise ValueError(f"opd_token_advantages: sample {i} has {len(p_row)} rollout log-probs, {len(q_row)} "
                             f"teacher log-probs and {len(mask)} loss-mask entries; they must match token for token")
        scored += 1
        row = []
        for p, q, m in zip(p_row, q_row, mask, strict=True):
            if not m:
                row.append(0.0)
                continue
            row.append(base + distill_coef * (q - p))
            kl, lq, lp, tokens = kl + (p - q), lq + q, lp + p, tokens + 1
        out.append(row)
    n = max(tokens, 1)
    metrics = {"distill/scored_samples": float(scored)}
    if tokens:
        metrics |= {"distill/reverse_kl": kl / n, "distill/teacher_logprob": lq / n, "distill/policy_logprob": lp / n}
    return out, metrics
