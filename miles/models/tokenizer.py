"""A small byte-level BPE tokenizer trained offline on a task's text, with Qwen's special tokens.

A real 152k-token vocabulary costs a tiny model more than the model itself
(~1.2 s per CPU step, see FACTS.md), so tiny runs train their own BPE with the
``tokenizers`` library in a few hundredths of a second. It follows Qwen where
it matters to the rest of the system:

- digits are split one per token (``Digits(individual_digits=True)``), so
  ``"482"`` is three tokens, as in Qwen's pre-tokenizer;
- byte-level, so any text encodes (no unknown token);
- ``<|endoftext|>`` is the pad token, ``<|im_end|>`` the end of a turn (eos),
  and a Qwen-style ChatML template renders
  ``<|im_start|>user\\n{content}<|im_end|>\\n<|im_start|>assistant\\n``.

The result is a plain :class:`transformers.PreTrainedTokenizerFast`: it is
saved with ``save_pretrained`` and loaded back with ``AutoTokenizer``.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""ChatML as Qwen writes it (without Qwen's tool and thinking branches)."""

_ROLES = ("system\n", "user\n", "assistant\n")
_MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # the byte alphabet plus the special tokens


def train_tokenizer(corpus: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of at most ``vocab_size`` tokens on ``corpus``; deterministic for a given corpus.

    Special token ids are fixed: ``<|endoftext|>`` 0 (pad), ``<|im_start|>`` 1, ``<|im_end|>`` 2 (eos).
    """
    if vocab_size < _MIN_VOCAB:
        raise ValueError(
            f"vocab_size: a byte-level BPE needs at least {_MIN_VOCAB} tokens (256 bytes + "
            f"{len(SPECIAL_TOKENS)} special tokens), found {vocab_size}; try {_MIN_VOCAB + 64}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The chat scaffold's role names are in every sequence: let them merge like the task's words.
    tok.train_from_iterator([*corpus, *_ROLES], trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        additional_special_tokens=[IM_START],
        model_max_length=4096,
        padding_side="left",  # prompts are left-padded for batched generation
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def encode_prompt(tokenizer: PreTrainedTokenizerFast, content: str, chat_template: bool = True) -> list[int]:
    """Token ids of one user turn plus the assistant header: exactly what a rollout engine is fed.

    With ``chat_template=False`` the text is encoded as it is (no special tokens added): for datasets
    whose prompts are already formatted.
    """
    if not chat_template:
        return list(tokenizer.encode(content, add_special_tokens=False))
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)
