"""GPUs through NVML (pynvml), with dcgm-exporter's metric names and labels.

One update reads every GPU (gpu_metrics.Reader), polls the XID sources (xid.py), maps GPU processes to the
trainer's ranks (RUN/control/ranks/rank-<r>.json) and renders the families. What can go wrong, and what the
collector does:

- no NVML library or driver, or no GPU: CollectorDisabled with one line saying which; the agent runs on.
- a reading a GPU does not support (NOT_SUPPORTED): that series is left out for that GPU, and the call is
  not made again until NVML is re-initialised.
- a GPU lost (GPU_IS_LOST, UNKNOWN: fell off the bus, driver wedged): trainguard_gpu_lost{gpu}=1, the other
  GPUs go on, and NVML is shut down and initialised again on a later update, with a backoff that doubles up
  to `reinit_backoff_max_seconds`; the GPU comes back when NVML answers for it again.

Options (collectors.gpu.*): `nvml_module` (the module answering as pynvml; tests name the fake),
`labels` ("trainguard" | "dcgm", see gpu_metrics.LABEL_STYLES), `pcie_throughput` (the 20 ms NVML PCIe
samples), `kmsg` (read XIDs from <devfs>/kmsg), `reinit_backoff_seconds`, `reinit_backoff_max_seconds`.
"""

from __future__ import annotations

import importlib
import time
from typing import Any

from trainguard import log

from ..collector import Collector, CollectorDisabled, Sample, register
from ..config import ConfigError
from ..procfs import RankPids
from trainguard.metrics import gpu_metrics
from trainguard.metrics.gpu_metrics import GPU, LABEL_STYLES, LOST, Reader, error_values
from .options import options
from .xid import KmsgSource, NvmlEventSource, XidCounts, pci_key_from_bus_id

_log = log.get("agent.gpu")

# the health counters and states the node-risk rule reads (decide/node_risk.py), kept in the node's TLS log
# under their reading names so replay sees what the live agent saw
HEALTH_READINGS = ("ecc_sbe_volatile", "ecc_dbe_volatile", "retired_pages", "retired_pending", "remapped_rows",
                   "remap_pending", "remap_failure", "pcie_replays", "pcie_downgrades", "nvlink_crc_errors",
                   "nvlink_replay_errors", "power_violation_ns", "thermal_violation_ns", "pcie_link_width",
                   "pcie_max_link_width")


@register
class GPUCollector(Collector):
    name = "gpu"
    interval = 5.0
    timeout = 10.0
    clock = staticmethod(time.monotonic)     # tests replace it to make NVLink bandwidth and backoff exact

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.opts = options(ctx.options, self.name, nvml_module=None, labels="trainguard", pcie_throughput=True,
                            kmsg=True, reinit_backoff_seconds=10.0, reinit_backoff_max_seconds=300.0)
        if self.opts["labels"] not in LABEL_STYLES:
            raise ConfigError(f"collectors.gpu.labels: expected one of {', '.join(LABEL_STYLES)}, "
                              f"got {self.opts['labels']!r}")
        self.nvml = _load_nvml(self.opts["nvml_module"] or "pynvml")
        self.lost_errors = error_values(self.nvml, LOST)
        self._backoff = self.opts["reinit_backoff_seconds"]
        self._reinit_at: float | None = None
        self.gpus = self._enumerate()
        self.reader = Reader(self.nvml, pcie_throughput=self.opts["pcie_throughput"])
        self.xids = XidCounts()
        self.rank_pids = RankPids(ctx.run_dir, ctx.node)
        self.kmsg = KmsgSource(ctx.devfs) if self.opts["kmsg"] else None
        self.events = self._event_source()

    # -------------------------------------------------------------------------------------- NVML set-up

    def _enumerate(self) -> list[GPU]:
        nvml = self.nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise CollectorDisabled(f"gpu: NVML is not available here ({exc}); GPU metrics are off") from None
        count = nvml.nvmlDeviceGetCount()
        if count == 0:
            nvml.nvmlShutdown()
            raise CollectorDisabled("gpu: NVML found no GPU; GPU metrics are off")
        gpus = []
        for index in range(count):
            try:
                gpus.append(self._identify(index))
            except nvml.NVMLError as exc:
                if exc.value not in self.lost_errors:
                    raise
                # lost before we could even learn its name: known by index until NVML answers for it
                gpus.append(GPU(index=index, uuid="", name="", pci_bus_id="", pci=""))
                self._mark_lost(gpus[-1], str(exc), self.clock())
        return gpus

    def _identify(self, index: int, into: GPU | None = None) -> GPU:
        nvml = self.nvml
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        bus_id = _text(nvml.nvmlDeviceGetPciInfo(handle).busId)
        gpu = into or GPU(index=index, uuid="", name="", pci_bus_id="", pci="")
        gpu.uuid, gpu.name = _text(nvml.nvmlDeviceGetUUID(handle)), _text(nvml.nvmlDeviceGetName(handle))
        gpu.pci_bus_id, gpu.pci, gpu.handle = bus_id, pci_key_from_bus_id(bus_id), handle
        return gpu

    def _event_source(self) -> NvmlEventSource:
        return NvmlEventSource(self.nvml, {gpu.pci: gpu.handle for gpu in self.gpus if not gpu.lost})

    def _reinit(self, now: float) -> None:
        """Shut NVML down and start it again; GPUs that answer by UUID get fresh handles and are no longer lost."""
        nvml = self.nvml
        self.events.close()
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass           # already down, or wedged: init decides
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            for gpu in self.gpus:
                self._mark_lost(gpu, f"nvmlInit: {exc}", now)
            return
        for gpu in self.gpus:
            gpu.unsupported.clear()
            gpu.nvlink_previous = None      # counters may have restarted with the driver
            gpu.gpm_sample = None           # a sample of the NVML that was shut down
            try:
                if gpu.uuid:
                    gpu.handle = nvml.nvmlDeviceGetHandleByUUID(gpu.uuid.encode())
                else:
                    self._identify(gpu.index, into=gpu)
            except nvml.NVMLError as exc:
                self._mark_lost(gpu, f"re-init: {exc}", now)
                continue
            gpu.recovering = gpu.recovering or gpu.lost     # confirmed by its next good reading
            gpu.lost, gpu.lost_reason = False, ""
        self.events = self._event_source()
        if not any(gpu.lost for gpu in self.gpus):
            self._reinit_at, self._backoff = None, self.opts["reinit_backoff_seconds"]

    def _mark_lost(self, gpu: GPU, reason: str, now: float) -> None:
        if not gpu.lost and not gpu.recovering:
            _log.warning("gpu lost", gpu=gpu.index, uuid=gpu.uuid, reason=reason)
        gpu.lost, gpu.lost_reason = True, reason
        if self._reinit_at is None or self._reinit_at <= now:
            self._reinit_at = now + self._backoff
            self._backoff = min(self._backoff * 2, self.opts["reinit_backoff_max_seconds"])

    # ------------------------------------------------------------------------------------------ update

    def update(self) -> Sample:
        now = self.clock()
        if self._reinit_at is not None and now >= self._reinit_at:
            self._reinit(now)
        readings = {}
        for gpu in self.gpus:
            if gpu.lost:
                continue
            try:
                readings[gpu.index] = self.reader.read(gpu, now)
            except self.nvml.NVMLError as exc:
                if exc.value not in self.lost_errors:
                    raise
                self._mark_lost(gpu, str(exc), now)
                continue
            if gpu.recovering:
                _log.info("gpu answering again after NVML re-init", gpu=gpu.index, uuid=gpu.uuid)
                gpu.recovering = False
        self.xids.add("nvml", self.events.poll())
        if self.kmsg is not None:
            self.xids.add("kmsg", self.kmsg.poll())
        sources = {"nvml": self.events.available, **({"kmsg": self.kmsg.available} if self.kmsg else {})}
        ranks = {pid: rank for rank, pid in self.rank_pids.get().items()}
        for gpu in self.gpus:
            if gpu.pci in self.xids.last and gpu.index in readings:
                readings[gpu.index]["last_xid"] = self.xids.last[gpu.pci]
        families = gpu_metrics.families(self.gpus, readings, self.xids.merged(), ranks, self.ctx.node,
                                        LABEL_STYLES[self.opts["labels"]], sources)
        return Sample(families=families, tls=self._tls(readings))

    def _tls(self, readings: dict[int, dict]) -> dict:
        xid_totals: dict[str, int] = {}
        xid_codes: dict[str, dict[str, int]] = {}
        for (pci, xid), count in self.xids.merged().items():
            xid_totals[pci] = xid_totals.get(pci, 0) + count
            xid_codes.setdefault(pci, {})[str(xid)] = count
        gpus = []
        for gpu in self.gpus:
            entry: dict[str, Any] = {"gpu": gpu.index, "uuid": gpu.uuid, "lost": gpu.lost,
                                     "xid_errors": xid_totals.get(gpu.pci, 0)}
            if gpu.pci in xid_codes:
                entry["xids"] = xid_codes[gpu.pci]       # per code: what the node-risk rule replays
            r = readings.get(gpu.index, {})
            for key in HEALTH_READINGS:
                if key in r:
                    entry[key] = r[key]
            for tls_key, key in (("gpu_util", "gpu_util"), ("mem_copy_util", "mem_copy_util"),
                                 ("gpu_temp_c", "gpu_temp_c"), ("gpu_power_w", "power_w"),
                                 ("power_limit_w", "power_limit_w"), ("mem_used_bytes", "mem_used_bytes"),
                                 ("mem_total_bytes", "mem_total_bytes"), ("sm_clock_mhz", "sm_clock_mhz"),
                                 ("mem_clock_mhz", "mem_clock_mhz")):
                if key in r:
                    entry[tls_key] = r[key]
            if "energy_mj" in r:    # NVML's total energy counter (mJ since the driver loaded): trainguard/energy.py
                entry["energy_joules"] = r["energy_mj"] / 1000.0
            if r.get("mem_total_bytes"):
                # TLS mem_util: how full the GPU's memory is, in percent (DCGM's MEM_COPY_UTIL is bandwidth)
                entry["mem_util"] = round(100.0 * r["mem_used_bytes"] / r["mem_total_bytes"], 2)
            gpus.append(entry)
        hardware: dict[str, Any] = {"gpus": gpus}
        for key in ("gpu_util", "mem_util", "gpu_temp_c", "gpu_power_w"):
            values = [g[key] for g in gpus if key in g]
            if values:
                hardware[key] = round(sum(values) / len(values), 2)
        return {"hardware": hardware, "system": {"gpu_count": len(self.gpus)}}

    def close(self) -> None:
        self.events.close()
        if self.kmsg is not None:
            self.kmsg.close()
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass


def _load_nvml(module: Any):
    """The pynvml-like module: a dotted name to import, or the module (or fake) object itself."""
    if not isinstance(module, str):
        return module
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise CollectorDisabled(f"gpu: cannot import {module} ({exc}); GPU metrics are off") from None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
