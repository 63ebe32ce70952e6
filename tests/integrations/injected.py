"""Faults the integration tests inject into a real training step."""

from __future__ import annotations

import torch

EXPLOSION = 1e3   # the gradient of an injected step, times this; its loss stays as it is


class ScaleGradient(torch.autograd.Function):
    """The identity forward; the gradient times `factor` backward: a gradient explosion the loss hides."""

    @staticmethod
    def forward(ctx, loss, factor):
        ctx.factor = factor
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None
