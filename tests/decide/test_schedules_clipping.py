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


def zclip_adaptive_reference(norms, *, warmup: int, alpha: float, z_thresh: float) -> list[float]:
    """ZClip's zscore mode with clip_option "adaptive_scaling", as its paper and reference zclip.py define
    it (no max_grad_norm), written out step by step: the norm each step is clipped to (None: not clipped)."""
    buffer, mean, var, out = [], None, None, []
    for norm in norms:
        if mean is None:
            buffer.append(norm)
            if len(buffer) == warmup:
                mean = sum(buffer) / len(buffer)
                var = sum((x - mean) ** 2 for x in buffer) / len(buffer)
            out.append(None)
            continue
        std = var ** 0.5
        z = (norm - mean) / (std + 1e-6)
        clip_to = mean + (z_thresh * std) / (z / z_thresh) if z > z_thresh else None
        learned = clip_to if clip_to is not None else norm
        mean = alpha * mean + (1 - alpha) * learned
        var = alpha * var + (1 - alpha) * (learned - mean) ** 2
        out.append(clip_to)
    return out


def test_zscore_adaptive_scaling_is_zclips_rule_step_for_step():
    rng = np.random.default_rng(0)
    norms = list(np.abs(rng.normal(1.0, 0.1, 200)))
    for at, factor in ((60, 30.0), (61, 5.0), (120, 3.0), (150, 300.0)):
        norms[at] *= factor
    policy = ClippingPolicy(warmup_steps=25, ema_alpha=0.97, z_thresh=2.5)
    clip = ZScoreClip(policy, fixed=1e9, adaptive_scaling=True)
    expected = zclip_adaptive_reference(norms, warmup=25, alpha=0.97, z_thresh=2.5)
    results = [clip.observe(norm) for norm in norms]
    for norm, want, got in zip(norms, expected, results):
        if want is None:
            assert not got.clipped
        else:
            assert got.threshold == pytest.approx(want, rel=1e-12) and got.coef == pytest.approx(want / (norm + 1e-6))
    assert sum(r.clipped for r in results) >= 4


def test_zscore_adaptive_scaling_clips_a_larger_outlier_harder_and_is_continuous():
    policy = ClippingPolicy(warmup_steps=3, ema_alpha=0.9, z_thresh=2.0)
    clip = ZScoreClip(policy, fixed=10.0, adaptive_scaling=True)
    for norm in (1.0, 1.1, 0.9):
        clip.observe(norm)
    mean, std = clip.mean, math.sqrt(clip.var)
    ceiling = clip.threshold()
    assert ceiling == pytest.approx(mean + 2.0 * std)
    assert clip.threshold_for(1.05) == ceiling                       # not an outlier: the ceiling, not clipped
    at_the_edge = mean + 2.0 * (std + 1e-6)
    assert clip.threshold_for(at_the_edge + 1e-9) == pytest.approx(ceiling, rel=1e-6)
    small, large = clip.threshold_for(2.0), clip.threshold_for(100.0)
    assert mean < large < small < ceiling                            # the larger outlier, the lower threshold
    z = (100.0 - mean) / (std + 1e-6)
    assert large == pytest.approx(mean + 2.0 * std / (z / 2.0))
    result = clip.observe(100.0)
    assert result.threshold == large and clip.mean == pytest.approx(0.9 * mean + 0.1 * large)   # learned
    plain = ZScoreClip(policy, fixed=10.0)
    for norm in (1.0, 1.1, 0.9):
        plain.observe(norm)
    assert plain.threshold_for(100.0) == plain.threshold() == pytest.approx(ceiling)    # off: unchanged


def test_zscore_adaptive_scaling_is_capped_round_trips_and_ignores_non_finite():
    policy = ClippingPolicy(warmup_steps=2, ema_alpha=0.9, z_thresh=2.0, max_norm=0.5)
    clip = ZScoreClip(policy, fixed=1.0, adaptive_scaling=True)
    clip.observe(1.0)
    clip.observe(2.0)
    assert clip.threshold_for(50.0) == 0.5 and clip.threshold() == 0.5
    before = clip.state_dict()
    assert clip.observe(float("nan")).coef == 1.0 and clip.observe(float("inf")).coef == 1.0
    assert clip.state_dict() == before
    twin = ZScoreClip(policy, fixed=1.0, adaptive_scaling=True)
    twin.load_state_dict(clip.state_dict())
    assert twin.threshold_for(7.0) == clip.threshold_for(7.0)
    assert not clipping.make("zscore", policy, fixed=1.0).adaptive_scaling    # not from the policy (docstring)
