"""Sampling math: top-k / top-p masks on hand-computed examples, and the exponential race's distribution."""

from __future__ import annotations

import math

import torch

from miles.rollout.sampling import filter_logits, filter_logits_rows, sample_tokens

NEG = float("-inf")


def test_top_k_and_top_p_masks_by_hand() -> None:
    # probs of [log .5, log .3, log .15, log .05] are exactly [.5, .3, .15, .05]
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]])
    keep = lambda x: torch.isfinite(x)[0].tolist()  # noqa: E731
    assert keep(filter_logits(logits, top_k=2)) == [True, True, False, False]
    assert keep(filter_logits(logits, top_p=0.5)) == [True, False, False, False]  # .5 reaches .5
    assert keep(filter_logits(logits, top_p=0.51)) == [True, True, False, False]
    assert keep(filter_logits(logits, top_p=0.9)) == [True, True, True, False]  # .8 < .9 <= .95
    assert keep(filter_logits(logits, top_p=0.01)) == [True, False, False, False]  # at least one token
    assert keep(filter_logits(logits, top_k=3, top_p=0.6)) == [True, True, False, False]
    assert keep(filter_logits(logits)) == [True] * 4
    # Unsorted input: the mask follows the values, not the positions.
    shuffled = logits[:, [2, 0, 3, 1]]
    assert keep(filter_logits(shuffled, top_p=0.75)) == [False, True, False, True]
    kept = filter_logits(logits, top_k=2)
    assert torch.equal(kept[0, :2], logits[0, :2])  # survivors are not changed


def test_exponential_race_matches_filtered_softmax() -> None:
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0]).expand(40_000, 5)
    noise = torch.empty(40_000, 5).exponential_()
    t = 0.7
    tokens = sample_tokens(logits, noise, temperature=t, top_k=4, top_p=0.95)
    freq = torch.bincount(tokens, minlength=5).float() / len(tokens)
    expected = filter_logits(logits[:1] / t, 4, 0.95).softmax(-1)[0]
    assert freq[expected == 0].sum().item() == 0.0
    # 40k draws: standard error <= 0.0025; 0.01 is 4 sigma
    torch.testing.assert_close(freq, expected, atol=0.01, rtol=0)


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, 11)
    assert torch.equal(sample_tokens(logits, None), logits.argmax(-1))


def test_per_row_filters_equal_the_scalar_filter_row_by_row() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    params = [(0, 1.0), (5, 1.0), (0, 0.3), (7, 0.8), (1, 0.9), (50, 0.999)]  # off, top-k, top-p, both, ...
    got = filter_logits_rows(logits, torch.tensor([k for k, _ in params]), torch.tensor([p for _, p in params]))
    for row, (k, p) in enumerate(params):
        want = filter_logits(logits[row : row + 1], top_k=k, top_p=p)[0]
        assert torch.equal(got[row], want), (k, p)
    assert torch.isfinite(got[0]).all() and torch.isfinite(got[1]).sum() == 5 and torch.isfinite(got[4]).sum() == 1


def test_evaluation_never_draws_a_training_groups_noise() -> None:
    """Evaluation groups have a seed stream of their own: no run seed's evaluation shares a seed with any
    training group of that run or of another (training group i of run seed s is seeded s * 1_000_003 + i)."""
    from miles.core.evaluate import eval_seed

    training = {s * 1_000_003 + i for s in range(8) for i in range(20_000)}
    evaluation = [eval_seed(s) + g for s in range(8) for g in range(1_000)]
    assert len(set(evaluation)) == len(evaluation)
    assert training.isdisjoint(evaluation)
    assert eval_seed(3) == eval_seed(3) != eval_seed(4)
