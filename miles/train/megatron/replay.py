"""Rollout routing replay (R3) in the megatron trainer: its routers send each token to the engine's experts.

The same contract as the FSDP trainer's :mod:`miles.train.routing_replay` (read it for the why): with
``replay`` every MoE layer sends each token that has a recorded route to exactly the experts the engine
chose, with gate weights from the trainer's own router logits (:func:`~miles.train.routing_replay.replay_gate`:
softmax in fp32, gathered at the recorded experts, renormalised with ``norm_topk_prob``), so the router
still learns; tokens without one (each sequence's last position, padding) keep the trainer's routing.
Without ``replay`` the routes are only measured. The metrics are FSDP's, from the same counts:

- ``moe/route_agreement``: recorded (token, layer, slot) routes whose expert is among the router's
  *own* top-k in the same forward (before replay): agreeing slots / recorded slots;
- ``moe/replayed_route_share``: recorded (token, layer) routes whose experts are exactly the ones the
  router module hands to the token dispatcher (its output ``routing_map``, read by a forward hook):
  1 under replay.

Where the routes enter: :class:`~miles.train.megatron.model.HFTopKRouter` calls :meth:`RouteReplay.route`
from its ``routing`` (megatron's ``MoELayer`` then permutes and dispatches what it returns, over the
expert-parallel ranks with the all-to-all dispatcher). Layouts:

* tokens: megatron's hidden states are ``[S, B, H]`` and the router flattens them sequence-major, so a
  micro-batch's routes ``[B, L, moe_layers, k]`` (:attr:`miles.train.batching.PaddedBatch.routes`)
  become ``[L * B, moe_layers, k]``;
* layers: the routes hold every MoE layer of the model; a pipeline stage's router picks its own from
  its global ``layer_number`` (1-based, pipeline offset included) and the model's MoE layer pattern;
* micro-batches: :meth:`Engine._run <miles.train.megatron.engine.Engine._run>` sets each micro-batch's
  routes right before its forward, and again when its backward starts (a gradient hook on the stage's
  output: :meth:`RouteReplay.hold`), so a backward that recomputes a layer (``trainer.activation_checkpointing``)
  replays that micro-batch's routes even when the 1F1B schedule ran later micro-batches' forwards in between;
* expert parallelism: routing happens on each rank's own tokens before the dispatch, so each rank
  replays the routes of its own data-parallel shard; counts are summed over all ranks.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from miles.train.megatron.arch import Arch
from miles.train.routing_replay import replay_gate


class RouteReplay:
    """Routing replay (``replay=True``) or measurement only, on the routers of one megatron model stage."""

    def __init__(self, model: nn.Module, arch: Arch, *, replay: bool) -> None:
        from miles.train.megatron.model import HFTopKRouter

        routers = [m for m in model.modules() if isinstance(m, HFTopKRouter)]
        if not routers:
            raise ValueError("routing replay needs an MoE model; this megatron model stage has no HFTopKRouter")
        self.num_moe_layers = sum(arch.moe_layers)
        self.replay = replay
        self.routes: Tensor | None = None  # [L * B, moe_layers, k] of the micro-batch being computed
        self.counts = torch.zeros(4, dtype=torch.float64)  # as miles.train.routing_replay.RouteReplay's
        self._layer: dict[int, int] = {}
        for router in routers:
            self._layer[id(router)] = sum(arch.moe_layers[: router.layer_number - 1])
            router.replay = self
            router.register_forward_hook(lambda mod, _in, out: self._dispatched(mod, out[1]))

    def set_routes(self, routes: Tensor | None) -> None:
        """Routes ``[B, L, moe_layers, k]`` (-1: none) for the next forward passes; None: the router's own."""
        if routes is not None and routes.shape[-2] != self.num_moe_layers:
            raise ValueError(f"routes have {routes.shape[-2]} MoE layers, the model has {self.num_moe_layers}")
        self.routes = None if routes is None else routes.transpose(0, 1).reshape(-1, *routes.shape[-2:])

    def hold(self, output: Tensor, routes: Tensor | None) -> None:
        """Set ``routes`` again when the backward of the pass that produced ``output`` starts."""
        if output.requires_grad:
            def again(grad: Tensor) -> Tensor:
                self.set_routes(routes)
                return grad

            output.register_hook(again)

    def take_counts(self) -> Tensor:
        """Counts since the last call, float64 [4]: agreeing slots, recorded slots, token-layers dispatched
        with exactly the recorded experts, recorded token-layers. Resets them."""
        out = self.counts.clone()
        self.counts.zero_()
        return out

    def _recorded(self, router: nn.Module, num_tokens: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """The router's recorded routes [N, k] (-1 clamped to 0) and the mask [N] of tokens that have one."""
        assert self.routes is not None
        rec = self.routes[:, self._layer[id(router)]].to(device)
        if rec.shape[0] != num_tokens:
            raise ValueError(f"routing replay: the forward has {num_tokens} tokens, the routes {rec.shape[0]}")
        return rec.clamp(min=0), rec[:, 0] >= 0

    def route(self, router: nn.Module, logits: Tensor, probs: Tensor, routing_map: Tensor) -> tuple[Tensor, Tensor]:
        """The router's own ``(probs, routing_map)`` [N, E] for ``logits`` [N, E] -> what it dispatches."""
        if self.routes is None:
            return probs, routing_map
        rec, have = self._recorded(router, logits.shape[0], logits.device)
        with torch.no_grad():
            hit = routing_map.gather(1, rec)[have]
            self.counts[0] += hit.sum().double().cpu()
            self.counts[1] += float(hit.numel())
        if not self.replay:
            return probs, routing_map
        gate = replay_gate(logits, rec, normalize=router.normalize)
        replayed = torch.zeros_like(probs).scatter(1, rec, gate.to(probs.dtype))
        chosen = torch.zeros_like(routing_map).scatter(1, rec, True)
        keep = have[:, None]
        return torch.where(keep, replayed, probs), torch.where(keep, chosen, routing_map)

    def _dispatched(self, router: nn.Module, routing_map: Tensor) -> None:
        if self.routes is None:
            return
        rec, have = self._recorded(router, routing_map.shape[0], routing_map.device)
        with torch.no_grad():
            recorded = torch.zeros_like(routing_map).scatter(1, rec, True)
            same = (routing_map == recorded).all(-1)[have]
            self.counts[2] += same.sum().double().cpu()
            self.counts[3] += float(same.numel())


def route_metrics(counts: Tensor) -> dict[str, float]:
    """``moe/route_agreement`` and ``moe/replayed_route_share`` from counts summed over ranks (where defined)."""
    agree, slots, same, routes = counts.tolist()
    out = {}
    if slots > 0:
        out["moe/route_agreement"] = agree / slots
    if routes > 0:
        out["moe/replayed_route_share"] = same / routes
    return out
