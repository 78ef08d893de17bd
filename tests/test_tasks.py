"""The arithmetic task: held-out split, determinism, reward, and the SFT loss."""

from __future__ import annotations

import math
import random

import pytest
import torch

from miles.models.warm_start import sft_loss
from miles.tasks.arithmetic import ArithmeticTask, Problem, exact_answer_reward


def test_eval_set_is_deterministic_and_distinct() -> None:
    a, b = ArithmeticTask().eval_problems(128), ArithmeticTask().eval_problems(128)
    assert a == b
    assert len(set(a)) == 128
    assert ArithmeticTask(eval_seed=7).eval_problems(128) != a


def test_training_samples_never_hit_the_eval_split() -> None:
    task = ArithmeticTask()
    heldout = {p.prompt for p in task.eval_problems(128)}
    train = task.sample(5000, random.Random(0))
    assert not heldout & {p.prompt for p in train}
    prompts = {p for p, _ in task.sft_examples(2000, random.Random(1))}
    assert not heldout & prompts


def test_problems_are_correct_and_mixed_in_difficulty() -> None:
    problems = ArithmeticTask().sample(2000, random.Random(0))
    for p in problems:
        a, op, b = p.prompt.removeprefix("What is ").removesuffix("?").split()
        assert int(p.label) == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0
    one_digit = sum(len(p.prompt) == len("What is 3 + 4?") for p in problems) / len(problems)
    assert 0.15 < one_digit < 0.35  # both operands 1-digit in about a quarter of problems


def test_sampling_is_reproducible_under_a_seed() -> None:
    task = ArithmeticTask()
    assert task.sample(50, random.Random(3)) == task.sample(50, random.Random(3))
    assert task.sample(50, random.Random(3)) != task.sample(50, random.Random(4))


def test_bad_task_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="ops"):
        ArithmeticTask(ops=("/",))
    with pytest.raises(ValueError, match="eval_problems"):
        ArithmeticTask(max_operand=3).eval_problems(128)


def test_corpus_covers_prompts_and_digits() -> None:
    corpus = ArithmeticTask().corpus()
    assert any(t.startswith("What is") for t in corpus)
    assert set("0123456789+-?") <= set("".join(corpus))


@pytest.mark.parametrize(
    ("text", "reward"),
    [("82", 1.0), (" 82\n", 1.0), ("81", 0.0), ("82 82", 0.0), ("082", 0.0), ("", 0.0), ("?!x", 0.0)],
)
def test_exact_answer_reward(text: str, reward: float) -> None:
    assert exact_answer_reward(text, Problem(prompt="What is 37 + 45?", label="82").label) == reward


def test_sft_loss_matches_hand_computation() -> None:
    # One sequence of 3 tokens, vocab 2; position 0 predicts labels[1], position 1 predicts labels[2].
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0], [5.0, 5.0]]])
    labels = torch.tensor([[-100, 1, 0]])
    # position 0: uniform -> -log(1/2); position 1: p(token 0) = 3 / (3 + 1) -> -log(3/4); mean of the two.
    expected = (-math.log(0.5) - math.log(0.75)) / 2
    assert sft_loss(logits, labels).item() == pytest.approx(expected, abs=1e-6)


def test_sft_loss_ignores_masked_tokens() -> None:
    logits = torch.randn(2, 5, 7)
    labels = torch.full((2, 5), -100)
    labels[0, 2] = 3
    manual = -torch.log_softmax(logits[0, 1], -1)[3]
    assert sft_loss(logits, labels).item() == pytest.approx(manual.item(), abs=1e-6)


# --- the largest-number task ---------------------------------------------------------------

def test_largest_task_answers_and_split() -> None:
    from miles.tasks.largest import LargestNumberTask

    task = LargestNumberTask(list_len=4, max_value=20)
    rng = random.Random(1)
    for p in task.sample(200, rng):
        numbers = [int(x) for x in p.prompt.split(":")[1].strip(" ?").split()]
        assert len(numbers) == 4 and p.label == str(max(numbers))
        assert not task.is_heldout_key(tuple(numbers))
    evals = task.eval_problems(50)
    assert evals == task.eval_problems(50) and len({p.prompt for p in evals}) == 50
    assert all(task.is_heldout_key(tuple(int(x) for x in p.prompt.split(":")[1].strip(" ?").split())) for p in evals)


def test_largest_task_rejects_bad_arguments() -> None:
    from miles.tasks.largest import LargestNumberTask

    for kwargs in ({"list_len": 1}, {"max_value": 0}, {"heldout_fraction": 1.0}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            LargestNumberTask(**kwargs)


def test_heldout_hash_is_stable_and_near_its_fraction() -> None:
    from miles.tasks.procedural import in_heldout

    keys = [f"k{i}" for i in range(4000)]
    share = sum(in_heldout(k, 7, 0.25) for k in keys) / len(keys)
    assert 0.22 < share < 0.28
    assert [in_heldout(k, 7, 0.25) for k in keys[:50]] == [in_heldout(k, 7, 0.25) for k in keys[:50]]
    assert [in_heldout(k, 7, 0.25) for k in keys[:200]] != [in_heldout(k, 8, 0.25) for k in keys[:200]]


# --- reasoning-gym tasks -------------------------------------------------------------------

GYM_ARITHMETIC = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2, operators=("+", "-"),
                      allow_parentheses=False, allow_negation=False)
GYM_COUNTDOWN = dict(min_numbers=3, max_numbers=3, min_value=1, max_value=20, min_target=10, max_target=99)


@pytest.fixture(scope="module")
def gym_tasks():
    from miles.tasks.gym import ReasoningGymTask

    return (ReasoningGymTask(dataset="basic_arithmetic", config=GYM_ARITHMETIC, pool_size=3000),
            ReasoningGymTask(dataset="countdown", config=GYM_COUNTDOWN, pool_size=600,
                             prompt_template="Make {target} from {numbers}"))


def test_gym_splits_never_overlap(gym_tasks) -> None:
    for task in gym_tasks:
        evals = task.eval_problems(40)
        assert evals == task.eval_problems(40)  # the same list every call
        heldout = {p.prompt for p in evals}
        assert len(heldout) == 40
        train = {p.prompt for p in task.sample(3000, random.Random(0))}
        assert len(train) > 100 and not heldout & train
        assert not heldout & {prompt for prompt, _ in task.sft_examples(500, random.Random(1))}


def test_gym_problems_score_with_reasoning_gyms_scorer(gym_tasks) -> None:
    from miles.rewards.gym import gym_reward

    arithmetic, countdown = gym_tasks
    for p in arithmetic.sample(50, random.Random(2)):
        a, op, b = p.prompt.removeprefix("Calculate ").removesuffix(".").split()
        answer = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert arithmetic.reference_response(p) == str(answer)
        assert gym_reward(f" {answer}\n", p.label) == 1.0
        assert gym_reward(str(answer + 1), p.label) == 0.0
    for p in countdown.sample(20, random.Random(3)):
        target, numbers = p.prompt.removeprefix("Make ").split(" from ")
        assert sorted(map(int, numbers.split())) == sorted(p.label["entry"]["metadata"]["numbers"])
        assert gym_reward(countdown.reference_response(p), p.label) == 1.0
        assert gym_reward(" + ".join(numbers.split()) + " + 1000", p.label) < 1.0  # right numbers, wrong value


def test_gym_prompts_fit_the_tiny_model(gym_tasks) -> None:
    from miles.models.qwen3 import QWEN3_FLAVORS
    from miles.models.tokenizer import encode_prompt, train_tokenizer

    for task in gym_tasks:
        tok = train_tokenizer(task.corpus(), 320)
        longest = max(len(encode_prompt(tok, p)) + len(tok.encode(r)) + 1 for p, r in task.sft_examples(300, random.Random(0)))
        assert longest < QWEN3_FLAVORS["tiny"]["max_position_embeddings"] // 4


def test_gym_task_rejects_bad_arguments() -> None:
    from miles.tasks.gym import ReasoningGymTask

    with pytest.raises(ValueError, match="did you mean 'countdown'"):
        ReasoningGymTask(dataset="countdwn")
    with pytest.raises(ValueError, match="config.seed"):
        ReasoningGymTask(dataset="countdown", config={"seed": 3})
    with pytest.raises(ValueError, match="config: reasoning-gym 'countdown' rejected"):
        ReasoningGymTask(dataset="countdown", config={"min_numbers": 1})
    with pytest.raises(ValueError, match="prompt_template.*available fields: .*numbers"):
        ReasoningGymTask(dataset="countdown", config=GYM_COUNTDOWN, prompt_template="Make {goal} from {numbers}")


def test_countdown_scorer_hang_is_stopped_by_the_runner() -> None:
    from miles.config import TargetConfig
    from miles.rewards.runner import RewardItem, RewardRunner
    from miles.tasks.gym import ReasoningGymTask

    p = ReasoningGymTask(dataset="countdown", config=GYM_COUNTDOWN, pool_size=50).sample(1, random.Random(0))[0]
    with RewardRunner(TargetConfig(target="miles.rewards.gym.gym_reward", partial=True), timeout_s=1.0) as r:
        out = r.score([RewardItem("9**9**9**9", p.label), RewardItem(p.label["entry"]["answer"], p.label)])
    assert out[0].failure == "timeout after 1s" and out[1].reward == 1.0
