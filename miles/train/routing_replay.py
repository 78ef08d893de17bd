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

Two metrics, both over the positions that carry a recorded route, measured whether replay is on or
off whenever the batch carries routes (with replay off, set ``rollout.engine.capture_routing=true``
to have them; such batches run without the shared-prompt forward):

- ``moe/route_agreement``: for every recorded token, layer and slot ``j``, whether the engine's
  expert ``e_j`` is among the trainer's *own* top-k (the router's choice in the same forward, before
  replay overrides it): agreeing slots / recorded slots. Replay does not change the router, so this
  stays below 1 under replay wherever the two sides' router logits pick different experts.
- ``moe/replayed_route_share``: for every recorded token and layer, whether the experts module was
  *called* with exactly the recorded set of experts (read from the experts module's input, after
  replay): such token-layers / recorded token-layers. 1 under replay; without replay it is the share
  of token-layers whose own top-k set equals the engine's.

The hooks are forward hooks on the routers (``*.mlp.gate`` modules with a ``top_k``; their output is
``(logits, top_k_weights, top_k_index)``) and forward pre-hooks on their sibling ``*.mlp.experts``
modules (input ``(hidden_states, top_k_index, top_k_weights)``), installed once;
:meth:`RouteReplay.set_routes` chooses the routes of the next forward passes and they stay until the
next call, so a backward that recomputes a layer (activation checkpointing) replays the same routes
(and counts its routes again, in both metrics).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def find_routers(model: nn.Module) -> list[nn.Module]:
    """The MoE routers of an HF Qwen3-MoE-style model, in layer order (``*.mlp.gate`` with ``top_k``)."""
    return [m for _, m in _moe_layers(model)]


def _moe_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, router) of every ``*.mlp.gate`` module with a ``top_k``, in layer order."""
    return [(name, m) for name, m in model.named_modules() if name.endswith(".mlp.gate") and hasattr(m, "top_k")]


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
    """Hooks on a model's MoE layers: replay (``replay=True``) or only measure the given routes."""

    def __init__(self, model: nn.Module, *, replay: bool) -> None:
        layers = _moe_layers(model)
        if not layers:
            raise ValueError(f"routing replay needs an MoE model with routers (*.mlp.gate with a top_k); "
                             f"{type(model).__name__} has none")
        modules = dict(model.named_modules())
        self.routers = [m for _, m in layers]
        self.replay = replay
        self.routes: Tensor | None = None  # [N, layers, k] of the next forward, N = B * L
        # agreeing slots, recorded slots, token-layers whose experts were called with the recorded set,
        # recorded token-layers (module docstring)
        self.counts = torch.zeros(4, dtype=torch.float64)
        for i, (name, router) in enumerate(layers):
            experts = modules.get(name.removesuffix(".gate") + ".experts")
            if experts is None:
                raise ValueError(f"routing replay: {name} has no sibling experts module "
                                 f"({name.removesuffix('.gate')}.experts) to check the routes it is called with")
            router.register_forward_hook(lambda mod, _in, out, i=i: self._router_hook(i, mod, out))
            experts.register_forward_pre_hook(lambda _mod, args, i=i: self._experts_hook(i, args[1]))

    def set_routes(self, routes: Tensor | None) -> None:
        """Routes [B, L, layers, k] (-1: none) for the following forward passes; None: the trainer's own."""
        if routes is not None and routes.shape[-2] != len(self.routers):
            raise ValueError(f"routes have {routes.shape[-2]} MoE layers, the model has {len(self.routers)}")
        self.routes = None if routes is None else routes.reshape(-1, *routes.shape[-2:])

    def take_counts(self) -> Tensor:
        """Counts since the last call, float64 [4]: agreeing slots, recorded slots (``moe/route_agreement``
        is the first over the second), token-layers computed with exactly the recorded experts, recorded
        token-layers (``moe/replayed_route_share``: the third over the fourth). Resets them."""
        out = self.counts.clone()
        self.counts.zero_()
        return out

    def _recorded(self, layer: int, num_tokens: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """This layer's recorded routes [N, k] and the mask [N] of the tokens that have one."""
        assert self.routes is not None
        rec = self.routes[:, layer].to(device)
        if rec.shape[0] != num_tokens:
            raise ValueError(f"routing replay: the forward has {num_tokens} tokens, the routes {rec.shape[0]}")
        return rec, rec[:, 0] >= 0

    def _router_hook(self, layer: int, router: nn.Module, out: tuple[Tensor, Tensor, Tensor]) -> tuple | None:
        if self.routes is None:
            return None
        logits, weights, own = out
        rec, have = self._recorded(layer, own.shape[0], own.device)
        with torch.no_grad():
            hit = (rec[:, :, None] == own[:, None, :]).any(-1)[have]
            self.counts[0] += hit.sum().double().cpu()
            self.counts[1] += float(hit.numel())
        if not self.replay:
            return None
        index = torch.where(have[:, None], rec, own)
        gate = replay_gate(logits, index, normalize=bool(getattr(router, "norm_topk_prob", False)))
        return logits, torch.where(have[:, None], gate, weights), index

    def _experts_hook(self, layer: int, used: Tensor) -> None:
        if self.routes is None:
            return
        rec, have = self._recorded(layer, used.shape[0], used.device)
        with torch.no_grad():
            same = (rec.sort(-1).values == used.sort(-1).values).all(-1)[have]
            self.counts[2] += same.sum().double().cpu()
            self.counts[3] += float(same.numel())
