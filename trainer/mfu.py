"""Model FLOPs utilisation: the FLOP/s a step achieved over the device's peak.

    mfu = flops_per_token * tokens_per_second / peak_flops_per_device

Peak figures are the vendors' dense (no 2:4 sparsity) tensor-core numbers for the dtype the trainer
uses on GPUs (bf16), from the data sheets. A CPU has no such figure, so on CPU the peak is measured
once per process with a float32 matmul (as is an unknown GPU, in bf16); `--peak-flops` (run.peak_flops)
overrides either.
"""

from __future__ import annotations

import math
import time

# Dense bf16 peak FLOP/s per device. Order matters: the first substring found in the device name wins,
# so the more specific names come first.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("GH200", 989e12),
    ("H200", 989e12),      # same compute as H100 SXM, more memory
    ("H100", 989e12),      # SXM
    ("H800", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
    ("V100", 125e12),      # fp16 tensor cores; V100 has no bf16
    ("T4", 65e12),         # fp16
)


def peak_for_device_name(name: str) -> float | None:
    """Table lookup by CUDA device name (``"NVIDIA H100 80GB HBM3"``); None when unknown."""
    for key, flops in PEAK_BF16_FLOPS:
        if key in name:
            return flops
    return None


def measure_flops(device_type: str = "cpu", seconds: float = 0.1) -> float:
    """Best matmul FLOP/s seen on this device over `seconds`: float32 on CPU (the practical ceiling for
    the tiny model), bf16 on a GPU the table does not know. The best single matmul, not the average,
    so other work on a shared machine lowers the figure as little as possible. Runs once at start-up,
    never in the step loop."""
    import torch

    size, dtype = (512, torch.float32) if device_type == "cpu" else (4096, torch.bfloat16)
    a = torch.randn(size, size, device=device_type, dtype=dtype)
    b = torch.randn(size, size, device=device_type, dtype=dtype)
    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    torch.mm(a, b)  # warm-up
    sync()
    best, deadline = math.inf, time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        torch.mm(a, b)
        sync()
        end = time.perf_counter()
        best = min(best, end - start)
        if end >= deadline:
            return 2.0 * size**3 / best


def peak_flops(device_type: str, device_name: str = "", override: float = 0.0) -> tuple[float, str]:
    """Peak FLOP/s per device and where the figure came from (``override``, ``table``, ``measured``)."""
    if override > 0:
        return override, "override"
    if device_type == "cuda":
        found = peak_for_device_name(device_name)
        if found:
            return found, "table"
    return measure_flops(device_type), "measured"


def mfu(flops_per_token: float, tokens_per_second: float, peak: float) -> float:
    return flops_per_token * tokens_per_second / peak if peak > 0 else 0.0
