"""Online training of the speculative draft (``draft.online``, docs/speculative.md).

A draft proposes well only while its next-token distribution ``q`` stays close to the policy's ``p``; RL
moves ``p``. :class:`DraftTrainer` is a Ray actor that holds the draft (a transformers causal LM, fp32) and
an AdamW, and takes one optimizer step per RL step on that step's samples: the mean cross-entropy of the
policy's own response tokens under ``softmax(z_draft / T)``, ``T`` the rollout temperature. The tokens were
sampled from ``p``, so this is a Monte-Carlo estimate of ``KL(p || q) + H(p)``: its minimiser is ``q = p``,
which is what the accept rule rewards (``sum min(p, q)``), and it needs no policy forward. Tokens an
environment wrote (``loss_mask`` 0) are not the policy's and are left out.

The driver pushes :meth:`state` to every engine with the policy's weights
(:meth:`miles.rollout.engine_spec.EngineSpeculation.update_draft`) and writes :meth:`save_state` into run
checkpoints, so a resumed run continues with the draft it had. Nothing here is collective: one process.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from miles.train.optim import flatten_optimizer_state, refuse_nonfinite, unflatten_optimizer_state

DraftSequence = tuple[Sequence[int], Sequence[int], Sequence[int]]
"""``(prompt_ids, response_ids, loss_mask)`` of one sample (``loss_mask`` over the response)."""


def draft_sequences(samples: Sequence[object]) -> list[DraftSequence]:
    """What the draft learns from in a step's samples: those with at least one token the policy generated."""
    return [(s.prompt_ids, s.response_ids, s.loss_mask) for s in samples  # type: ignore[attr-defined]
            if any(s.loss_mask)]  # type: ignore[attr-defined]


class DraftTrainer:
    """The online draft: ``checkpoint_dir``'s model, trained by :meth:`train` (see the module docstring).

    ``temperature``: the rollout temperature the samples were drawn at (0 or less: greedy rollouts, trained at
    1); ``micro_batch``: sequences per forward (the gradient of a step is accumulated over all of them);
    ``max_grad_norm``: clipping of the step's gradient (0: none).
    """

    def __init__(self, checkpoint_dir: str, *, lr: float, temperature: float = 1.0, micro_batch: int = 16,
                 max_grad_norm: float = 1.0, num_threads: int = 1, seed: int = 0) -> None:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(num_threads)
        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32,
                                                          attn_implementation="sdpa").train()
        self.temperature = temperature if temperature > 0 else 1.0
        self.micro_batch, self.max_grad_norm = micro_batch, max_grad_norm
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.steps = 0
        self._names = {id(p): n for n, p in self.model.named_parameters()}

    def health(self) -> dict[str, object]:
        return {"ok": True, "steps": self.steps}

    def train(self, sequences: Sequence[DraftSequence]) -> dict[str, float]:
        """One AdamW step on ``sequences``: the mean cross-entropy over every response token the policy
        generated. Returns ``draft/loss``, ``draft/top1`` (how often the draft's argmax is the sampled
        token, before this update: a proxy of greedy acceptance), ``draft/tokens``, ``draft/grad_norm``,
        ``draft/steps`` (optimizer steps taken so far) and ``draft/train_s``.
        A step whose loss or gradient is not finite is skipped (``draft/nonfinite_skipped`` 1)."""
        t0 = time.perf_counter()
        seqs = [s for s in sequences if any(s[2])]
        if not seqs:
            return {}
        total = sum(int(sum(m)) for _, _, m in seqs)
        loss_sum, top1 = 0.0, 0
        self.optimizer.zero_grad(set_to_none=True)
        for lo in range(0, len(seqs), self.micro_batch):
            chunk = seqs[lo:lo + self.micro_batch]
            width = max(len(p) + len(r) for p, r, _ in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            attn = torch.zeros(len(chunk), width, dtype=torch.long)
            weight = torch.zeros(len(chunk), width)  # 1 where the token at that position is a target
            for b, (p, r, m) in enumerate(chunk):
                n = len(p) + len(r)
                ids[b, :n] = torch.tensor([*p, *r], dtype=torch.long)
                attn[b, :n] = 1
                weight[b, len(p):n] = torch.tensor(m, dtype=torch.float32)
            logits = self.model(input_ids=ids, attention_mask=attn).logits[:, :-1].float() / self.temperature
            targets, w = ids[:, 1:], weight[:, 1:]
            nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
            loss = (nll.view_as(w) * w).sum() / total
            loss.backward()
            loss_sum += float(loss.detach())
            top1 += int(((logits.argmax(-1) == targets).float() * w).sum())
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
                     if self.max_grad_norm > 0 else torch.linalg.vector_norm(torch.stack(
                         [torch.linalg.vector_norm(g) for g in grads])))
        out = {"draft/loss": loss_sum, "draft/top1": top1 / total, "draft/tokens": float(total),
               "draft/grad_norm": norm}
        if math.isfinite(loss_sum) and math.isfinite(norm):
            self.optimizer.step()
            self.steps += 1
            out["draft/nonfinite_skipped"] = 0.0
        else:
            out["draft/nonfinite_skipped"] = 1.0
        self.optimizer.zero_grad(set_to_none=True)
        return out | {"draft/steps": float(self.steps), "draft/train_s": time.perf_counter() - t0}

    def state(self) -> dict[str, torch.Tensor]:
        """CPU copies of the draft's weights (HF names), what the engines load."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def save_state(self, directory: str) -> None:
        """The draft's weights, AdamW state and step count into ``directory`` (safetensors + JSON), written
        into ``<directory>.tmp`` and renamed into place; refused when a weight is not finite."""
        from safetensors.torch import save_file

        final = Path(directory)
        model_sd = self.model.state_dict()
        refuse_nonfinite(model_sd, final, rank=0, world_size=1, device="cpu")
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        seen: set[int] = set()  # tied weights share storage, which safetensors refuses: save a copy
        save_file({k: v.clone() if v.data_ptr() in seen or seen.add(v.data_ptr()) else v.contiguous()
                   for k, v in model_sd.items()}, str(tmp / "model.safetensors"))
        tensors, groups = flatten_optimizer_state(self._named_optimizer_state())
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        (tmp / "draft_state.json").write_text(json.dumps({"steps": self.steps, "param_groups": groups}))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)

    def load_state(self, directory: str) -> None:
        """Restore what :meth:`save_state` wrote (the same draft architecture)."""
        from safetensors.torch import load_file

        path = Path(directory)
        meta = json.loads((path / "draft_state.json").read_text())
        missing, unexpected = self.model.load_state_dict(load_file(str(path / "model.safetensors")), strict=False)
        if [k for k in missing if k not in _tied(self.model)] or unexpected:
            raise ValueError(f"draft state {path}: not this draft's weights (missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]})")
        named = unflatten_optimizer_state(load_file(str(path / "optimizer.safetensors")), meta["param_groups"])
        index = {n: i for i, n in enumerate(self._names[id(p)] for p in self.model.parameters())}
        self.optimizer.load_state_dict({
            "state": {index[n]: st for n, st in named["state"].items()},
            "param_groups": [g | {"params": [index[n] for n in g["params"]]} for g in named["param_groups"]]})
        self.steps = int(meta["steps"])

    def _named_optimizer_state(self) -> dict[str, object]:
        """AdamW's state dict keyed by parameter name (what :func:`flatten_optimizer_state` takes)."""
        osd = self.optimizer.state_dict()
        order = [self._names[id(p)] for g in self.optimizer.param_groups for p in g["params"]]
        return {"state": {order[i]: st for i, st in osd["state"].items()},
                "param_groups": [g | {"params": [order[i] for i in g["params"]]} for g in osd["param_groups"]]}


def _tied(model: torch.nn.Module) -> set[str]:
    """State-dict names that alias another parameter (tied embeddings), which a load may leave out."""
    names = {n for n, _ in model.named_parameters()}
    return {k for k in model.state_dict() if k not in names}
