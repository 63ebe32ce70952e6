"""Adaptive clipping (decide/clipping.py) and the layer-targeted rollback response (decide/layers.py)."""

import math

import numpy as np
import pytest

from trainguard.decide import clipping
from trainguard.decide.clipping import Clipped, PercentileClip, ZScoreClip, coefficient
from trainguard.decide.decision import Decision
from trainguard.decide.layers import LayerResponse
from trainguard.policy import ClippingPolicy, LayerResponsePolicy


def test_coefficient_is_torchs():
    assert coefficient(1.0, 0.5) == 1.0
    assert coefficient(1.0, 4.0) == pytest.approx(1.0 / (4.0 + 1e-6))
    assert coefficient(1.0, float("nan")) == 1.0


def test_fixed_clips_at_its_threshold_always():
    clip = clipping.make("fixed", ClippingPolicy(), fixed=1.0)
    assert clip.threshold() == 1.0
    assert clip.observe(0.5) == Clipped(1.0, 1.0) and not clip.observe(0.5).clipped
    assert clip.observe(2.0).clipped and clip.observe(2.0).metrics()["clip_threshold"] == 1.0


def test_zscore_uses_the_fixed_threshold_until_warm_then_mean_plus_z_std():
    policy = ClippingPolicy(warmup_steps=4, ema_alpha=0.9, z_thresh=2.0)
    clip = ZScoreClip(policy, fixed=1.0)
    for norm in (1.0, 2.0, 3.0):
        assert clip.observe(norm).threshold == 1.0
    clip.observe(2.0)                                       # fourth norm: the EMAs start from the plain stats
    mean, var = 2.0, np.var([1.0, 2.0, 3.0, 2.0])
    assert (clip.mean, clip.var) == pytest.approx((mean, var))
    assert clip.threshold() == pytest.approx(mean + 2.0 * math.sqrt(var))


def test_zscore_clips_a_spike_and_learns_the_clipped_norm_not_the_spike():
    policy = ClippingPolicy(warmup_steps=3, ema_alpha=0.9, z_thresh=2.0)
    clip = ZScoreClip(policy, fixed=10.0)
    for norm in (1.0, 1.1, 0.9):
        clip.observe(norm)
    threshold = clip.threshold()
    result = clip.observe(100.0)
    assert result.threshold == threshold and result.coef == pytest.approx(threshold / (100.0 + 1e-6))
    assert result.clipped
    expected_mean = 0.9 * 1.0 + 0.1 * threshold             # the EMA took the clipped value
    assert clip.mean == pytest.approx(expected_mean)
    assert clip.threshold() < 2.0                           # a spike does not open the gate for the next
    before = clip.state_dict()
    clip.observe(float("inf"))                              # never learned from
    assert clip.state_dict() == before


def test_zscore_max_norm_caps_and_state_round_trips():
    clip = ZScoreClip(ClippingPolicy(warmup_steps=2, z_thresh=50.0, max_norm=1.5), fixed=1.0)
    clip.observe(1.0)
    clip.observe(2.0)
    assert clip.threshold() == 1.5
    twin = ZScoreClip(clip.policy, fixed=1.0)
    twin.load_state_dict(clip.state_dict())
    assert twin.threshold() == clip.threshold()


def test_percentile_is_numpys_percentile_of_the_recent_norms():
    policy = ClippingPolicy(warmup_steps=5, percentile=10.0, history=8)
    clip = PercentileClip(policy, fixed=1.0)
    norms = [3.0, 1.0, 4.0, 1.5, 5.0, 9.0, 2.6, 5.3, 5.8, 9.7]
    seen = []
    for norm in norms:
        expected = 1.0 if len(seen) < 5 else float(np.percentile(seen[-8:], 10.0))
        result = clip.observe(norm)
        assert result.threshold == pytest.approx(expected)
        assert result.coef == pytest.approx(min(1.0, expected / (norm + 1e-6)))
        seen.append(norm)
    twin = PercentileClip(policy, fixed=1.0)
    twin.load_state_dict(clip.state_dict())
    assert twin.threshold() == clip.threshold() and len(twin.history) == 8


def test_unknown_rule_is_refused():
    with pytest.raises(ValueError, match="unknown clip rule"):
        clipping.make("agc", ClippingPolicy(), fixed=1.0)


# ------------------------------------------------------------------------------------------ layers

def rollback(layer=None, reason="repeated_grad_explosion"):
    detail = {"grad_norm": 9.0, "threshold": 2.0} | ({"layer": layer} if layer else {})
    return Decision("rollback", reason, 40, 0.0, detail)


def test_a_layer_that_caused_a_rollback_gets_its_lr_multiplier_lowered_down_to_the_floor():
    response = LayerResponse(LayerResponsePolicy(lr_factor=0.5, min_multiplier=0.2), reinit=True)
    cut = response.on_decision(rollback("h.1"))
    assert cut.detail() == {"layer_lr_multiplier": 0.5, "layer_lr_multiplier_before": 1.0, "layer_reinit": True}
    response.on_decision(rollback("h.1"))
    assert response.on_decision(rollback("h.1")).after == 0.2      # floor
    assert response.multiplier("h.0") == 1.0


def test_no_layer_no_rollback_no_cut_and_multipliers_survive_a_restart():
    response = LayerResponse(LayerResponsePolicy())
    assert response.on_decision(rollback()) is None                              # global norm
    assert response.on_decision(Decision("skip_step", "grad_explosion", 3, 0.0, {"layer": "h.0"})) is None
    response.on_decision(rollback("embed"))
    restarted = LayerResponse(LayerResponsePolicy())
    restarted.load_state_dict(response.state_dict())
    assert restarted.multipliers == {"embed": 0.5}
