"""Token-in-token-out sessions with the project's byte-level BPE tokenizer and its ChatML template."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from miles.agent.session import Session, TemplateDriftError
from miles.models.tokenizer import train_tokenizer
from miles.types import GenerateResult, Status

CORPUS = ['What is 123 * 456? <tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call>',
          "<tool_response>\n56088\n</tool_response> the answer is 56088 abab"] * 4


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(CORPUS, 320)


def _result(tok, text: str, *, eos: bool = True, logprob: float = -0.5, ids: list[int] | None = None
            ) -> GenerateResult:
    """What an engine returns for ``text`` (its canonical ids unless ``ids`` is given), ending on <|im_end|>."""
    ids = list(ids if ids is not None else tok.encode(text, add_special_tokens=False))
    ids += [tok.eos_token_id] if eos else []
    return GenerateResult(request_id="r", index=0, response_ids=tuple(ids), logprobs=(logprob,) * len(ids),
                          status=Status.COMPLETED if eos else Status.TRUNCATED, weight_version=3)


def test_three_turns_keep_every_id_and_mask(tok) -> None:
    s = Session(tok, [{"role": "user", "content": "What is 123 * 456?"}])
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 123 * 456?"}], tokenize=True,
                                     add_generation_prompt=True, return_dict=False)
    assert s.prompt_ids == list(prompt)
    turns, snapshots = [], []
    for i, text in enumerate(['<tool_call>{"name": "calculator"}</tool_call>', "<tool_call>{}</tool_call>", "56088"]):
        r = replace(_result(tok, text, logprob=-0.1 * (i + 1)), weight_version=[4, 3, 5][i])
        assert s.add_policy(r) == text
        turns.append((list(r.response_ids), 1))
        if i < 2:
            obs = s.add_messages([{"role": "user", "content": f"<tool_response>\n{i}\n</tool_response>"}])
            turns.append((obs, 0))
        snapshots.append(list(s.ids))
    # Byte for byte: the prompt, then each turn's ids in order; earlier turns never change.
    assert s.ids == list(prompt) + [t for ids, _ in turns for t in ids]
    assert all(snapshots[-1][:len(a)] == a for a in snapshots)
    assert s.loss_mask == [m for ids, m in turns for _ in ids]
    assert s.logprobs[:len(turns[0][0])] == [-0.1] * len(turns[0][0])
    assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.loss_mask, strict=True) if m == 0)
    # An observation turn closes the assistant turn and opens the next one, as the template does.
    assert tok.decode(turns[1][0]) == "\n<|im_start|>user\n<tool_response>\n0\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert s.weight_version == 3 and s.status is Status.COMPLETED and s.policy_turns == 3  # the oldest turn's
    assert s.drift() is None and s.finish() is None


def test_a_non_canonical_policy_tokenization_is_reported(tok) -> None:
    a, b = tok.convert_tokens_to_ids(["a", "b"])
    assert tok.encode("ab", add_special_tokens=False) != [a, b]  # the tokenizer merges "ab"
    s = Session(tok, [{"role": "user", "content": "What is 1 + 2?"}])
    s.add_policy(_result(tok, "3"))
    s.add_messages([{"role": "user", "content": "sure?"}])
    s.add_policy(_result(tok, "ab", ids=[a, b]))  # the engine sampled "a" then "b"
    drift = s.drift()
    assert drift is not None and drift.turn == 3 and drift.position == len(s.ids) - 3
    assert drift.session_ids[:2] == (a, b) and "turn 3" in drift.describe(tok)
    assert s.response_ids[-3:] == [a, b, tok.eos_token_id]  # the session keeps what was sampled
    strict = Session(tok, [{"role": "user", "content": "x"}], strict=True)
    strict.add_policy(_result(tok, "ab", ids=[a, b]))
    with pytest.raises(TemplateDriftError, match="turn 1.*strict mode"):
        strict.finish()


def test_a_template_that_rewrites_past_turns_is_refused(tok) -> None:
    """Like Qwen3's, this template drops the <think> part of earlier assistant turns."""
    rewriting = copy.deepcopy(tok)
    rewriting.chat_template = (
        "{%- for m in messages %}{%- set c = m['content'] %}"
        "{%- if m['role'] == 'assistant' and not loop.last %}{%- set c = c.split('</think>')[-1] %}{%- endif %}"
        "{{- '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    s = Session(rewriting, [{"role": "user", "content": "q"}])
    s.add_policy(_result(rewriting, "plain"))
    s.add_messages([{"role": "user", "content": "more"}])  # nothing to rewrite: fine
    s.add_policy(_result(rewriting, "<think>ab</think>1"))
    before = (list(s.ids), list(s.messages))
    with pytest.raises(TemplateDriftError, match="rewrote an earlier turn"):
        s.add_messages([{"role": "user", "content": "again"}])
    assert (s.ids, s.messages) == before  # refused: nothing appended


def test_truncated_turn_is_closed_by_the_next_delta(tok) -> None:
    s = Session(tok, [{"role": "user", "content": "q"}])
    s.add_policy(_result(tok, "123", eos=False))
    assert s.status is Status.TRUNCATED
    delta = s.add_messages([{"role": "user", "content": "go on"}])
    assert tok.decode(delta).startswith("<|im_end|>\n<|im_start|>user\ngo on")
    assert s.drift() is None


def test_drop_last_turn_restores_the_session(tok) -> None:
    s = Session(tok, [{"role": "user", "content": "q"}])
    s.add_policy(_result(tok, "1"))
    before = (list(s.ids), list(s.loss_mask), list(s.messages))
    first = s.add_messages([{"role": "user", "content": "<tool_response>\n2\n</tool_response>"}])
    s.drop_last_turn()
    assert (s.ids, s.loss_mask, s.messages) == before
    assert s.add_messages([{"role": "user", "content": "<tool_response>\n2\n</tool_response>"}]) == first
    assert s.drift() is None


def test_second_turn_warm_start_prompts_render_as_the_session_does() -> None:
    """The tool task's second-turn examples: their rendered prompt is the session's ids at that turn."""
    import random

    from miles.agent.tasks import CalculatorArithmeticTask
    from miles.agent.tools import ToolOutcome, tool_response_message
    from miles.models.tokenizer import encode_prompt

    task = CalculatorArithmeticTask(second_turn_fraction=1.0)
    tok = train_tokenizer(task.corpus(), 400)
    (prompt, answer), = task.sft_examples(1, random.Random(0))
    problem = next(p for p in task.sample(50, random.Random(0)) if prompt.startswith(p.prompt + "<|im_end|>"))
    s = Session(tok, [{"role": "user", "content": problem.prompt}])
    s.add_policy(_result(tok, task.reference_response(problem)))
    s.add_messages([tool_response_message([ToolOutcome(name="calculator", text=problem.label)])])
    assert encode_prompt(tok, prompt) == s.ids and answer == problem.label


def _leading_space_tokenizer():
    """A SentencePiece-style BPE (Metaspace ``▁``, prepended to the first word of a text, as Llama's and
    Mistral's tokenizers do) with the project's ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from miles.models.tokenizer import CHAT_TEMPLATE, IM_END, IM_START, PAD_TOKEN, SPECIAL_TOKENS

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    raw.decoder = decoders.Metaspace(prepend_scheme="first")
    corpus = [f"what is {a} plus {b}? {a + b}" for a in range(10) for b in range(10)] + ["user assistant sure?"]
    raw.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=200, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=list("\n▁?abcdefghijklmnopqrstuvwxyz0123456789<>|_/")))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token=PAD_TOKEN, eos_token=IM_END,
                                  additional_special_tokens=[IM_START])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def test_a_leading_space_tokenizer_keeps_the_sampled_ids_and_adds_no_token_between_turns() -> None:
    """The known drift of SentencePiece tokenizers: the policy samples ``▁7`` (a word-initial 7), whose text
    decodes to "7", and "7" re-tokenizes to another id; a turn's delta encoded on its own would also start
    with a ``▁`` the whole conversation does not have. The session keeps ``▁7`` as sampled, the agent's
    reply sent back as it got it continues the record, and the environment turn has the canonical ids."""
    from miles.agent.server_requests import chat_messages, off_record

    tok = _leading_space_tokenizer()
    question = [{"role": "user", "content": "what is 3 plus 4?"}]
    sampled = tok.convert_tokens_to_ids(["▁7"])
    assert tok.decode(sampled) == "7"
    s = Session(tok, question)
    text = s.add_policy(_result(tok, "", ids=sampled))
    follow_up = {"role": "user", "content": "sure?"}
    sent = [*question, {"role": "assistant", "content": text}, follow_up]
    assert off_record(s, sent, chat_messages(sent)) is None
    delta = s.add_messages([follow_up])
    whole = tok.apply_chat_template([*question, {"role": "assistant", "content": "7"}, follow_up],
                                    add_generation_prompt=True, tokenize=True, return_dict=False)
    assert sampled[0] not in whole  # re-rendered, the reply is another token
    assert tok.convert_ids_to_tokens(tok.encode("\n<|im_start|>user", add_special_tokens=False))[0] == "▁"
    assert delta == whole[-len(delta):] and tok.convert_ids_to_tokens(delta)[0] == "\n"  # no "▁" of its own
    assert s.response_ids[:2] == sampled + [tok.eos_token_id] and s.loss_mask[:2] == [1, 1]
    drift = s.drift()  # only the sampled token itself differs from a re-rendering
    assert drift is not None and drift.turn == 1 and drift.session_ids[0] == sampled[0]
    assert s.ids[drift.position + 1:] == whole[drift.position + 1:]


def test_a_turn_off_the_record_keeps_the_record_and_its_text(tok) -> None:
    s = Session(tok, [{"role": "user", "content": "q"}])
    s.add_policy(_result(tok, "1"))
    record = (list(s.ids), list(s.logprobs), list(s.loss_mask))
    sent = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "1 (edited)"},
            {"role": "user", "content": "more"}]
    assert s.render_ids(sent) == tok.apply_chat_template(sent, add_generation_prompt=True, tokenize=True,
                                                         return_dict=False)
    assert s.add_unrecorded(sent, _result(tok, "2"), "edited") == "2"
    s.add_unrecorded([*s.messages, {"role": "user", "content": "again"}], _result(tok, "3"), "later")
    assert (list(s.ids), list(s.logprobs), list(s.loss_mask)) == record
    assert s.policy_turns == 1 and s.masked_turns == 2 and s.off_record == "edited"
    assert [m["content"] for m in s.messages if m["role"] == "assistant"] == ["1 (edited)", "2", "3"]
    assert s.policy_messages == [1, 3, 5]
