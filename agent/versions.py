"""Software versions of a node, found once and cheaply: package metadata and files, never `import torch`.

Importing torch would cost the agent seconds of CPU and hundreds of MB of memory, for one string. torch's
version comes from its package metadata, its CUDA version from `torch/version.py` read as text, NCCL's
from the `nvidia-nccl-cu*` wheel torch depends on, the driver's from sysfs/procfs. Only when torch was
built with CUDA and no NCCL wheel is installed (a source or conda build) does the agent ask
`torch.cuda.nccl.version()`, once, and only if the host collector's option `nccl_from_torch` is on (the default).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
import re
from pathlib import Path

import trainguard
from trainguard.agent.collector import Context

NCCL_WHEELS = ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-nccl-cu11")


def package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""


def torch_cuda_version() -> str:
    """The CUDA version torch was built with, from torch/version.py ("" for a CPU build or no torch)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return ""
    for location in spec.submodule_search_locations:
        try:
            text = (Path(location) / "version.py").read_text()
        except OSError:
            continue
        match = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
        return match.group(1) if match else ""
    return ""


def nccl_version(cuda: str, ask_torch: bool) -> str:
    for wheel in NCCL_WHEELS:
        version = package_version(wheel)
        if version:
            return version
    if cuda and ask_torch:
        try:
            import torch   # once, in the collector's thread; see the module docstring

            if torch.cuda.is_available():
                return ".".join(str(part) for part in torch.cuda.nccl.version())
        except Exception:
            return ""
    return ""


def driver_version(ctx: Context) -> str:
    """The NVIDIA kernel driver's version from sysfs, else /proc/driver/nvidia/version ("" without one)."""
    try:
        return (ctx.sysfs / "module" / "nvidia" / "version").read_text().strip()
    except OSError:
        pass
    try:
        text = (ctx.procfs / "driver" / "nvidia" / "version").read_text()
    except OSError:
        return ""
    match = re.search(r"Kernel Module\s+(?:for\s+\S+\s+)?(\d[\w.-]*)", text)
    return match.group(1) if match else ""


def kernel_version(ctx: Context) -> str:
    try:
        return (ctx.procfs / "sys" / "kernel" / "osrelease").read_text().strip()
    except OSError:
        return platform.release()


def software_versions(ctx: Context, ask_torch: bool = True) -> dict[str, str]:
    cuda = torch_cuda_version()
    return {"python": platform.python_version(), "trainguard": trainguard.__version__,
            "torch": package_version("torch"), "cuda": cuda,
            "nccl": nccl_version(cuda, ask_torch),
            "driver": driver_version(ctx), "kernel": kernel_version(ctx)}
