"""The GPT and its FLOP count; the peak FLOP/s table and MFU."""

from __future__ import annotations

import pytest
import torch

from trainguard.runtime import mfu
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


@pytest.mark.parametrize("name, precision, tflops", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.5),      # the SXM part's name
    ("NVIDIA H100 PCIe", "bf16", 756.5),
    ("NVIDIA H100 NVL", "fp16", 835.5),
    ("NVIDIA H200", "tf32", 494.5),
    ("NVIDIA H200 NVL", "bf16", 835.5),
    ("NVIDIA GH200 480GB", "bf16", 990),           # not the H200 row
    ("NVIDIA B200", "bf16", 2250),
    ("NVIDIA GB200", "tf32", 1250),                # not the B200 row
    ("NVIDIA A100-SXM4-80GB", "bf16", 312),
    ("NVIDIA A100 80GB PCIe", "tf32", 156),
    ("NVIDIA A10", "fp16", 125),
    ("NVIDIA L4", "bf16", 121),
    ("NVIDIA L40S", "bf16", 362.05),
    ("NVIDIA L40", "tf32", 90.5),
    ("Tesla T4", "fp16", 65),
])
def test_peak_table_by_gpu_model_and_precision(name, precision, tflops):
    peak, flops = mfu.lookup(name, precision)
    assert flops == pytest.approx(tflops * 1e12) and peak.source          # every row names its data sheet
    found = mfu.peak_flops("cuda", name, precision)
    assert found.flops == flops and found.source.startswith(f"table: {peak.model} {precision}") and not found.reason


@pytest.mark.parametrize("name, precision", [
    ("NVIDIA A10G", "bf16"),           # the cloud part: no NVIDIA data sheet, and not the A10's figures
    ("NVIDIA H100", "bf16"),           # neither SXM nor PCIe nor NVL: which one is unknown
    ("Tesla T4", "bf16"),              # no bf16 tensor cores
    ("Some New Accelerator", "bf16"),
])
def test_no_peak_where_none_is_documented(name, precision):
    assert mfu.lookup(name, precision) is None
    found = mfu.peak_flops("cuda", name, precision)
    assert found.flops is None and precision in found.reason and "--peak-flops" in found.reason


def test_cpu_has_no_peak_and_the_override_wins():
    cpu = mfu.peak_flops("cpu")
    assert cpu.flops is None and "cpu" in cpu.reason
    assert mfu.peak_flops("cpu", override=5e11) == mfu.PeakFlops(5e11, "override")
    assert mfu.peak_flops("cuda", "NVIDIA H100 80GB HBM3", override=5e14) == mfu.PeakFlops(5e14, "override")
    assert not hasattr(mfu, "measure_flops")        # a start-up measurement is never a peak again
    with pytest.raises(ValueError, match="precision"):
        mfu.lookup("NVIDIA H100 PCIe", "fp32")
    assert mfu.mfu(1e9, 100.0, 1e12) == 0.1
