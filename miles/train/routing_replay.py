"""Rollout routing replay (R3) for Qwen3-MoE in the trainer, and the route-agreement metric.

Without replay the trainer's router recomputes each token's top-k experts from its own numbers,
and a small difference in the router logits (other kernels, other batch shapes, other precision)
flips the choice for some tokens: the trainer then scores a different network than the one that
sampled (arXiv 2510.11370 reports ~10% of routes differing). Replay takes the routes the engine
recorded (``PaddedBatch.routes``: ``[B, L, moe_layers, top_k]``, -1 where none) and makes every
MoE layer send each token to exactly those experts, while the *gate weights* still come from the
trainer's router,

    p = softmax(router_logits)                       [N, E] (fp32), trainer's own logits
    w_j = p[e_j] / sum_i p[e_i]   (norm_topk_prob)   at the recorded experts e_1..e_k

so the router's weight keeps receiving gradients through ``w`` (the expert choice itself is not
differentiable either way). Positions without a recorded route (each sequence's last token,
padding) keep the trainer's own routing.

Agreement. For every recorded token, layer and slot ``j`` the metric counts whether the engine's
expert ``e_j`` is among the trainer's own top-k (computed in the same forward, before replay
overrides it): ``moe/route_agreement = agreeing slots / recorded slots``. It is measured whether
replay is on or off, whenever the batch carries routes (with replay off, set
``rollout.engine.capture_routing=true`` to have them); such batches run without the shared-prompt
forward.

The hooks are forward hooks on the routers (``*.mlp.gate`` modules with a ``top_k``; their output is
``(logits, top_k_weights, top_k_index)``), installed once; :meth:`RouteReplay.set_routes` chooses the
routes of the next forward passes and they stay until the next call, so a backward that recomputes
a layer (activation checkpointing) replays the same routes.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def find_routers(model: nn.Module) -> list[nn.Module]:
    """The MoE routers of an HF Qwen3-MoE-style model, in layer order (``*.mlp.gate`` with ``top_k``)."""
    return [m for name, m in model.named_modules() if name.endswith(".mlp.gate") and hasattr(m, "top_k")]


def replay_gate(logits: Tensor, index: Tensor, *, normalize: bool) -> Tensor:
    """Gate weights of the experts ``index`` from the router's logits.

    logits: [N, E], index: [N, k] int64 -> [N, k] in ``logits.dtype``: the softmax (fp32) probabilities
    at ``index``, divided by their sum when ``normalize`` (Qwen3-MoE's ``norm_topk_prob``).
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    w = probs.gather(-1, index)
    if normalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(logits.dtype)


class RouteReplay:
    """Forward hooks on a model's routers: replay (``replay=True``) or only measure the given routes."""

    def __init__(self, model: nn.Module, *, replay: bool) -> None:
        self.routers = find_routers(model)
        if not self.routers:
            raise ValueError(f"routing replay needs an MoE model with routers (*.mlp.gate with a top_k); "
                             f"{type(model).__name__} has none")
        self.replay = replay
        self.routes: Tensor | None = None  # [N, layers, k] of the next forward, N = B * L
        self.agree = torch.zeros((), dtype=torch.float64)
        self.total = torch.zeros((), dtype=torch.float64)
        for i, m in enumerate(self.routers):
            m.register_forward_hook(lambda mod, _in, out, i=i: self._hook(i, mod, out))

    def set_routes(self, routes: Tensor | None) -> None:
        """Routes [B, L, layers, k] (-1: none) for the following forward passes; None: the trainer's own."""
        if routes is not None and routes.shape[-2] != len(self.routers):
            raise ValueError(f"routes have {routes.shape[-2]} MoE layers, the model has {len(self.routers)}")
        self.routes = None if routes is None else routes.reshape(-1, *routes.shape[-2:])

    def take_agreement(self) -> tuple[Tensor, Tensor]:
        """(agreeing slots, recorded slots) counted since the last call; resets both."""
        out = (self.agree.clone(), self.total.clone())
        self.agree.zero_()
        self.total.zero_()
        return out

    def _hook(self, layer: int, router: nn.Module, out: tuple[Tensor, Tensor, Tensor]) -> tuple | None:
        if self.routes is None:
            return None
        logits, weights, own = out
        rec = self.routes[:, layer].to(own.device)
        if rec.shape[0] != own.shape[0]:
            raise ValueError(f"routing replay: the forward has {own.shape[0]} tokens, the routes {rec.shape[0]}")
        have = rec[:, 0] >= 0  # [N]
        with torch.no_grad():
            hit = (rec[:, :, None] == own[:, None, :]).any(-1)[have]
            self.agree += hit.sum().double().cpu()
            self.total += float(hit.numel())
        if not self.replay:
            return None
        index = torch.where(have[:, None], rec, own)
        gate = replay_gate(logits, index, normalize=bool(getattr(router, "norm_topk_prob", False)))
        return logits, torch.where(have[:, None], gate, weights), index
