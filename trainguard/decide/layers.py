"""The layer-targeted response to a rollback: when one layer's gradient norm caused it, that layer's LR
multiplier is lowered (and, opt-in, its parameters are initialised again by the trainer).

    response = LayerResponse(policy.dynamics.layers)
    cut = response.on_decision(decision)     # a guard decision; None unless a layer caused a rollback
    cut.detail()                             # goes into the rollback event
    response.multipliers                     # {layer: multiplier}; kept across rollbacks and restarts

The guard names the layer furthest over its threshold in a ``repeated_grad_explosion`` rollback's detail
(`layer`); a rollback caused by the global norm, a loss spike or NaN names none and cuts nothing (the
guard's LR cut for the whole model applies to every rollback). Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from trainguard.actions import ROLLBACK
from trainguard.config import SHARE, key
from trainguard.decide.decision import Decision


@dataclass(frozen=True)
class LayerResponsePolicy:
    """A rollback caused by one layer's gradient norm lowers that layer's LR multiplier."""

    lr_factor: float = key(0.5, SHARE, "the layer's LR multiplier is multiplied by this at such a rollback")
    min_multiplier: float = key(0.05, SHARE, "... never under this")


class LayerCut(NamedTuple):
    layer: str
    before: float
    after: float
    reinit: bool

    def detail(self) -> dict[str, Any]:
        return {"layer_lr_multiplier": self.after, "layer_lr_multiplier_before": self.before,
                "layer_reinit": self.reinit}


class LayerResponse:
    def __init__(self, policy: LayerResponsePolicy, reinit: bool = False):
        self.policy, self.reinit = policy, reinit
        self.multipliers: dict[str, float] = {}

    def multiplier(self, layer: str) -> float:
        return self.multipliers.get(layer, 1.0)

    def on_decision(self, decision: Decision) -> LayerCut | None:
        layer = decision.detail.get("layer")
        if decision.action != ROLLBACK or not isinstance(layer, str):
            return None
        before = self.multiplier(layer)
        after = max(self.policy.min_multiplier, before * self.policy.lr_factor)
        self.multipliers[layer] = after
        return LayerCut(layer, before, after, self.reinit)

    def state_dict(self) -> dict[str, Any]:
        return {"multipliers": dict(self.multipliers)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.multipliers = {str(k): float(v) for k, v in state.get("multipliers", {}).items()}
