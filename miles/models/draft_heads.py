"""The policy's own draft heads (``draft.heads``, docs/speculative.md): speculation without a second model.

Head ``j`` (``j = 0 .. k - 1``) reads the policy's final-normed hidden state ``h_t`` at position ``t`` and
proposes the token at position ``t + 2 + j`` through the policy's own LM head:
``q_j = softmax(filter(lm_head(h_t + SiLU(W_j h_t + b_j)) / T))`` (a Medusa-style residual block per head).
The torch engine (:class:`miles.rollout.speculative.DraftHeads`) keeps ``h`` of each row's last fed token, so
a round's ``k`` proposals cost one batched matmul and one LM head over ``k`` positions instead of ``k``
forwards of a draft model; the policy then verifies them as it verifies a draft model's (exact speculative sampling: the proposals change how many
tokens a round keeps, never their distribution). ``W = 0, b = 0`` (a new set of heads) proposes from the
policy's next-token distribution at ``t``; training (:class:`miles.train.draft.DraftTrainer`, warm start
and ``draft.online``) fits ``q_j`` to the policy's distribution of that later token.

A set of heads is a directory: :data:`META` (``k``, ``hidden_size``, what it was trained on) and
:data:`WEIGHTS` (``weight`` [k, D, D], ``bias`` [k, D], safetensors).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

META, WEIGHTS = "draft_heads.json", "draft_heads.safetensors"


class PolicyHeads(nn.Module):
    """``k`` residual blocks on a hidden state: ``h -> [h + SiLU(W_j h + b_j) for j < k]``."""

    def __init__(self, k: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(k, hidden_size, hidden_size))
        self.bias = nn.Parameter(torch.zeros(k, hidden_size))

    @property
    def k(self) -> int:
        return int(self.weight.shape[0])

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden [..., D] -> [..., k, D]."""
        z = torch.einsum("...d,jed->...je", hidden, self.weight) + self.bias
        return hidden.unsqueeze(-2) + F.silu(z)

    def one(self, j: int, hidden: Tensor) -> Tensor:
        """Head ``j`` alone: hidden [..., D] -> [..., D] (``forward(hidden)[..., j, :]``)."""
        return hidden + F.silu(F.linear(hidden, self.weight[j], self.bias[j]))


def is_heads_dir(path: str | Path) -> bool:
    return Path(path).joinpath(META).is_file()


def save_heads(heads: PolicyHeads, out: str | Path, **meta: Any) -> Path:
    """Write ``heads`` into ``out`` (created; its files replaced), with ``meta`` beside ``k`` and ``hidden_size``."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in heads.state_dict().items()}, str(out / WEIGHTS))
    (out / META).write_text(json.dumps({"k": heads.k, "hidden_size": int(heads.weight.shape[1]), **meta}, indent=2))
    return out


def load_heads(path: str | Path, dtype: torch.dtype = torch.float32) -> PolicyHeads:
    """The heads saved in ``path`` (:func:`save_heads`), in ``dtype``."""
    from safetensors.torch import load_file

    path = Path(path)
    meta = json.loads((path / META).read_text())
    heads = PolicyHeads(int(meta["k"]), int(meta["hidden_size"]))
    state = load_file(str(path / WEIGHTS))
    missing, unexpected = heads.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"draft heads {path}: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    return heads.to(dtype)
