"""The GPT and its FLOP count; the peak FLOP/s table and MFU."""

from __future__ import annotations

import torch

from trainguard.trainer import mfu
from trainguard.trainer.config import ModelConfig
from trainguard.trainer.model import GPT


def test_gpt_returns_logits_and_loss_and_counts_flops():
    config = ModelConfig(n_layer=2, n_head=2, n_embd=64, block_size=16)
    model = GPT(config)
    idx = torch.randint(0, 256, (3, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 16, 256) and loss.item() > 0
    assert model(idx)[1] is None
    n = model.num_params()
    assert n == sum(p.numel() for p in model.parameters()) - 16 * 64
    assert model.flops_per_token() == 6 * n + 12 * 2 * 2 * 32 * 16         # 6N + 12·L·H·Q·T


def test_every_parameter_has_a_layer():
    model = GPT(ModelConfig(n_layer=3, n_head=2, n_embd=32, block_size=8))
    names, owners = model.layer_of_parameters()
    assert names == ["embed", "h.0", "h.1", "h.2", "ln_f"]
    assert len(owners) == len(list(model.parameters())) and set(owners) == set(range(5))


def test_peak_table_prefers_the_specific_name_and_the_override_wins():
    assert mfu.peak_for_device_name("NVIDIA H100 80GB HBM3") == 989e12
    assert mfu.peak_for_device_name("NVIDIA H100 PCIe") == 756e12
    assert mfu.peak_for_device_name("NVIDIA H200") == 989e12
    assert mfu.peak_for_device_name("NVIDIA A100-SXM4-80GB") == 312e12
    assert mfu.peak_for_device_name("Some New Accelerator") is None
    assert mfu.peak_flops("cuda", "NVIDIA H100 80GB HBM3", override=5e14) == (5e14, "override")
    assert mfu.peak_flops("cuda", "NVIDIA A100-SXM4-40GB") == (312e12, "table")
    measured, source = mfu.peak_flops("cpu")
    assert source == "measured" and measured > 1e8
    assert mfu.mfu(1e9, 100.0, 1e12) == 0.1
