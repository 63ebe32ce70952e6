"""Model FLOPs utilisation: the FLOP/s a step achieved over the device's documented peak.

    mfu = flops_per_token * tokens_per_second / peak_flops_per_device

MFU is only as true as its peak, so the peak comes from one of two places and nowhere else:

- the table below: NVIDIA's data-sheet figures by GPU model, **dense** (the sheets print the 2:4
  sparsity figure with an asterisk; dense is half of it), for the precision the matrix math runs in
  (``bf16``, ``fp16`` or ``tf32``), matched on the CUDA device name (``torch.cuda.get_device_name``, which
  is NVML's model name: ``"NVIDIA H100 80GB HBM3"``);
- a figure the user gives (``--peak-flops``, ``run.peak_flops``, ``StepTelemetry(peak_flops=...)``).

Anything else (a CPU, a GPU the table does not name, a precision the model has no tensor-core figure
for) has **no** MFU: the metric is left out and the report, `status` and the dashboards say "n/a" with
the reason. An earlier version measured a matmul at start-up instead; on a shared CPU that figure varied
30x between two starts and gave an MFU of 370%, so it is gone for good.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PRECISIONS = ("bf16", "fp16", "tf32")
TERA = 1e12


@dataclass(frozen=True)
class Peak:
    """Dense tensor-core TFLOP/s of one GPU model by precision (None: the model has no such figure)."""

    model: str
    pattern: str                 # regex searched in the device name; word bounds keep A10 off A10G
    bf16: float | None
    fp16: float | None
    tf32: float | None
    source: str


# Dense TFLOP/s, from the data sheets named in `source` (sparse figure / 2 where the sheet prints only that).
# Order matters where names nest: the first pattern found in the device name wins.
PEAKS: tuple[Peak, ...] = (
    Peak("GB200", r"\bGB200\b", 2500, 2500, 1250,
         "NVIDIA GB200 NVL72 data sheet, per Blackwell GPU (360/360/180 PFLOPS sparse for 72 GPUs)"),
    Peak("B200", r"\bB200\b", 2250, 2250, 1125,
         "NVIDIA HGX B200 data sheet, per GPU (36/36/18 PFLOPS sparse for 8 GPUs)"),
    Peak("GH200", r"\bGH200\b", 990, 990, 494, "NVIDIA GH200 Grace Hopper Superchip data sheet (dense column)"),
    Peak("H200 NVL", r"\bH200 NVL\b", 835.5, 835.5, 417.5,
         "NVIDIA H200 data sheet, H200 NVL column (1,671/1,671/835 TFLOPS sparse)"),
    Peak("H200 SXM", r"\bH200\b", 989.5, 989.5, 494.5,
         "NVIDIA H200 data sheet, H200 SXM column (1,979/1,979/989 TFLOPS sparse)"),
    Peak("H100 NVL", r"\bH100 NVL\b", 835.5, 835.5, 417.5,
         "NVIDIA H100 data sheet, H100 NVL column (1,671/1,671/835 TFLOPS sparse)"),
    Peak("H100 PCIe", r"\bH100 PCIe\b", 756.5, 756.5, 378,
         "NVIDIA H100 data sheet, H100 PCIe column (1,513/1,513/756 TFLOPS sparse)"),
    # The SXM part reports itself as "NVIDIA H100 80GB HBM3"; a bare "H100" of another form stays unknown.
    Peak("H100 SXM", r"\bH100\b.*\b(SXM|HBM3)\b", 989.5, 989.5, 494.5,
         "NVIDIA H100 data sheet, H100 SXM column (1,979/1,979/989 TFLOPS sparse)"),
    Peak("A100", r"\bA100\b", 312, 312, 156,
         "NVIDIA A100 data sheet (SXM and PCIe, 40 and 80 GB: the same dense figures)"),
    Peak("L40S", r"\bL40S\b", 362.05, 362.05, 183, "NVIDIA L40S data sheet (dense column)"),
    Peak("L40", r"\bL40\b", 181.05, 181.05, 90.5, "NVIDIA L40 data sheet (dense column)"),
    Peak("L4", r"\bL4\b", 121, 121, 60, "NVIDIA L4 data sheet (242/242/120 TFLOPS sparse)"),
    Peak("A10", r"\bA10\b", 125, 125, 62.5, "NVIDIA A10 data sheet (dense column)"),
    Peak("RTX 4090", r"\bRTX 4090\b", 165.2, 165.2, 82.6,
         "NVIDIA Ada Lovelace architecture white paper, appendix A (FP32 accumulate, dense)"),
    Peak("V100 SXM2", r"\bV100-SXM", None, 125, None, "NVIDIA V100 data sheet (no bf16 or tf32 tensor cores)"),
    Peak("V100 PCIe", r"\bV100-PCIE", None, 112, None, "NVIDIA V100 data sheet (no bf16 or tf32 tensor cores)"),
    Peak("T4", r"\bT4\b", None, 65, None, "NVIDIA T4 data sheet (mixed-precision FP16; no bf16 or tf32)"),
)


@dataclass(frozen=True)
class PeakFlops:
    """The peak MFU divides by, or why there is none: `flops` is None exactly when `reason` says why."""

    flops: float | None
    source: str          # "table: <model> <precision> (<data sheet>)", "override", or "" when unknown
    reason: str = ""     # why no MFU: shown as "n/a (<reason>)"


def lookup(device_name: str, precision: str = "bf16") -> tuple[Peak, float] | None:
    """The table row for a CUDA device name and its dense peak FLOP/s in `precision`; None when the model
    is not in the table or has no figure for that precision."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    for peak in PEAKS:
        if re.search(peak.pattern, device_name):
            tflops = getattr(peak, precision)
            return (peak, tflops * TERA) if tflops else None
    return None


def peak_flops(device_type: str, device_name: str = "", precision: str = "bf16",
               override: float = 0.0) -> PeakFlops:
    """Peak FLOP/s per device: the user's figure, else the table's for a CUDA device, else none (and why)."""
    if override > 0:
        return PeakFlops(override, "override")
    if device_type != "cuda":
        return PeakFlops(None, "", f"no documented peak FLOPs for a {device_type} device; "
                                   "give one with --peak-flops / peak_flops to get MFU")
    found = lookup(device_name, precision)
    if found is None:
        return PeakFlops(None, "", f"no documented {precision} peak for {device_name or 'this GPU'} in "
                                   "runtime/mfu.py; give one with --peak-flops / peak_flops")
    peak, flops = found
    return PeakFlops(flops, f"table: {peak.model} {precision} ({peak.source})")


def mfu(flops_per_token: float, tokens_per_second: float, peak: float) -> float:
    return flops_per_token * tokens_per_second / peak
