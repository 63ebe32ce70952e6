"""What the gpu collector reads from NVML for one GPU, and how the readings become metric families.

Reading and rendering are separate so a GPU that is lost half-way through its reads contributes nothing
(rather than half a GPU), and so the rendering is a pure function the tests can call.

Names, units and help follow dcgm-exporter (etc/default-counters.csv and the DCGM field list): FB memory in
MiB, power in W, energy in mJ, clocks in MHz, PCIe throughput in KB/s, NVLink bandwidth in DCGM's MB/s. All
DCGM_* series are gauges: DCGM's names do not end in _total, so exposing its cumulative fields as counters would
fail `promtool check metrics`, and PromQL's rate() works on them either way. What DCGM has no field for is
exported as trainguard_gpu_*, in base units, with _total counters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable

from prometheus_client.core import Metric

from trainguard import xid_catalog
from trainguard.metrics.families import LabelCache, Spec

MiB = 2**20
UINT_MAX = 0xFFFFFFFF

# Errors meaning "this GPU has no such reading": the series is left out, the collector carries on.
# The first two will not change while NVML runs, so the call is not made again until a re-init.
NEVER_SUPPORTED = ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND")
NOT_NOW = ("NVML_ERROR_NO_PERMISSION", "NVML_ERROR_NO_DATA", "NVML_ERROR_NOT_READY")
# Errors meaning the GPU itself is gone (fell off the bus, driver wedged): trainguard_gpu_lost, then re-init.
LOST = ("NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_UNKNOWN", "NVML_ERROR_GPU_NOT_FOUND", "NVML_ERROR_RESET_REQUIRED")

# Batched in one nvmlDeviceGetFieldValues call per GPU: reading -> (NVML field constant, scope id)
FIELDS = {
    "ecc_sbe_volatile": ("NVML_FI_DEV_ECC_SBE_VOL_TOTAL", 0),
    "ecc_dbe_volatile": ("NVML_FI_DEV_ECC_DBE_VOL_TOTAL", 0),
    "ecc_sbe_aggregate": ("NVML_FI_DEV_ECC_SBE_AGG_TOTAL", 0),
    "ecc_dbe_aggregate": ("NVML_FI_DEV_ECC_DBE_AGG_TOTAL", 0),
    "memory_temp_c": ("NVML_FI_DEV_MEMORY_TEMP", 0),
    "pcie_replays": ("NVML_FI_DEV_PCIE_REPLAY_COUNTER", 0),
    "nvlink_crc_flit_errors": ("NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", 0),
    "nvlink_crc_data_errors": ("NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL", 0),
    "nvlink_replay_errors": ("NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", 0),
    "nvlink_recovery_errors": ("NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", 0),
    "nvlink_links": ("NVML_FI_DEV_NVLINK_LINK_COUNT", 0),
    # scope UINT_MAX: summed over all links (nvml.h); KiB since the driver loaded
    "nvlink_tx_kib": ("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", UINT_MAX),
    "nvlink_rx_kib": ("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", UINT_MAX),
    "pcie_tx_bytes": ("NVML_FI_DEV_PCIE_COUNT_TX_BYTES", 0),
    "pcie_rx_bytes": ("NVML_FI_DEV_PCIE_COUNT_RX_BYTES", 0),
    # time (ns) the clocks were held down by a power or a thermal policy since the driver loaded: DCGM's
    # DCGM_FI_DEV_POWER_VIOLATION / _THERMAL_VIOLATION read the same counters (nvmlDeviceGetViolationStatus)
    "power_violation_ns": ("NVML_FI_DEV_PERF_POLICY_POWER", 0),
    "thermal_violation_ns": ("NVML_FI_DEV_PERF_POLICY_THERMAL", 0),
}

# NVML GPM metrics (Hopper and later: nvmlGpmQueryDeviceSupport) -> the DCGM profiling field that reads the same
# ratio; GPM answers percent (0-100), DCGM's fields are ratios (0-1). On an older GPU, or one whose GPM NVML
# refuses, the four families are absent (docs/collectors.md), never 0.
GPM_METRICS = (
    ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "NVML_GPM_METRIC_GRAPHICS_UTIL", "Ratio of time the graphics engine is active."),
    ("DCGM_FI_PROF_SM_ACTIVE", "NVML_GPM_METRIC_SM_UTIL", "The ratio of cycles an SM has at least 1 warp assigned."),
    ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "NVML_GPM_METRIC_ANY_TENSOR_UTIL",
     "Ratio of cycles the tensor (HMMA) pipe is active."),
    ("DCGM_FI_PROF_DRAM_ACTIVE", "NVML_GPM_METRIC_DRAM_BW_UTIL",
     "Ratio of cycles the device memory interface is active sending or receiving data."),
)

# (DCGM name, reading, help) -> one gauge per GPU
DCGM_GAUGES = (
    ("DCGM_FI_DEV_GPU_UTIL", "gpu_util", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "mem_copy_util", "Memory utilization (in %)."),
    ("DCGM_FI_DEV_FB_USED", "fb_used_mib", "Framebuffer memory used (in MiB)."),
    ("DCGM_FI_DEV_FB_FREE", "fb_free_mib", "Framebuffer memory free (in MiB)."),
    ("DCGM_FI_DEV_FB_TOTAL", "fb_total_mib", "Framebuffer memory total (in MiB)."),
    ("DCGM_FI_DEV_GPU_TEMP", "gpu_temp_c", "GPU temperature (in C)."),
    ("DCGM_FI_DEV_MEMORY_TEMP", "memory_temp_c", "Memory temperature (in C)."),
    ("DCGM_FI_DEV_POWER_USAGE", "power_w", "Power draw (in W)."),
    ("DCGM_FI_DEV_ENFORCED_POWER_LIMIT", "power_limit_w", "Effective power limit that the driver enforces (in W)."),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "energy_mj", "Total energy consumption since boot (in mJ)."),
    ("DCGM_FI_DEV_SM_CLOCK", "sm_clock_mhz", "SM clock frequency (in MHz)."),
    ("DCGM_FI_DEV_MEM_CLOCK", "mem_clock_mhz", "Memory clock frequency (in MHz)."),
    # DCGM 3.3+'s name (DCGM_FI_DEV_CLOCK_THROTTLE_REASONS before): what current dcgm-exporter dashboards read
    ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "throttle_reasons", "Current clock event reasons (bitmask of "
                                                             "nvmlClocksEventReason*)."),
    # the pre-3.3 name of the same field, kept as DCGM keeps it (dcgm_fields.h: #define DCGM_FI_DEV_CLOCK_THROTTLE_REASONS
    # DCGM_FI_DEV_CLOCKS_EVENT_REASONS), so dashboards written for older dcgm-exporters still draw
    ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "throttle_reasons", "Current clock throttle reasons (bitmask; the "
                                                              "old name of DCGM_FI_DEV_CLOCKS_EVENT_REASONS)."),
    ("DCGM_FI_DEV_POWER_VIOLATION", "power_violation_ns", "Throttling duration due to power constraints (in ns)."),
    ("DCGM_FI_DEV_THERMAL_VIOLATION", "thermal_violation_ns",
     "Throttling duration due to thermal constraints (in ns)."),
    ("DCGM_FI_DEV_PCIE_LINK_GEN", "pcie_link_gen", "PCIe link generation now."),
    ("DCGM_FI_DEV_PCIE_LINK_WIDTH", "pcie_link_width", "PCIe link width now (lanes)."),
    ("DCGM_FI_DEV_PCIE_MAX_LINK_GEN", "pcie_max_link_gen", "PCIe link generation the GPU and slot support."),
    ("DCGM_FI_DEV_PCIE_MAX_LINK_WIDTH", "pcie_max_link_width", "PCIe link width the GPU and slot support (lanes)."),
    ("DCGM_FI_DEV_PCIE_TX_THROUGHPUT", "pcie_tx_kbps", "PCIe TX throughput (in KB/s), NVML's 20 ms sample."),
    ("DCGM_FI_DEV_PCIE_RX_THROUGHPUT", "pcie_rx_kbps", "PCIe RX throughput (in KB/s), NVML's 20 ms sample."),
    ("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "nvlink_bandwidth", "NVLink data throughput, TX+RX over all links, "
                                                               "since the last update (in MB/s, as DCGM)."),
    ("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "nvlink_crc_flit_errors",
     "Total number of NVLink flow-control CRC errors."),
    ("DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL", "nvlink_crc_data_errors", "Total number of NVLink data CRC errors."),
    ("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "nvlink_replay_errors", "Total number of NVLink retries."),
    ("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", "nvlink_recovery_errors",
     "Total number of NVLink recovery errors."),
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "ecc_sbe_volatile", "Total number of single-bit volatile ECC errors."),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "ecc_dbe_volatile", "Total number of double-bit volatile ECC errors."),
    ("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "ecc_sbe_aggregate", "Total number of single-bit persistent ECC errors."),
    ("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "ecc_dbe_aggregate", "Total number of double-bit persistent ECC errors."),
    ("DCGM_FI_DEV_RETIRED_SBE", "retired_sbe", "Total number of retired pages due to single-bit errors."),
    ("DCGM_FI_DEV_RETIRED_DBE", "retired_dbe", "Total number of retired pages due to double-bit errors."),
    ("DCGM_FI_DEV_RETIRED_PENDING", "retired_pending", "Total number of pages pending retirement."),
    ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "remapped_correctable", "Number of remapped rows for correctable errors"),
    ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "remapped_uncorrectable",
     "Number of remapped rows for uncorrectable errors"),
    ("DCGM_FI_DEV_ROW_REMAP_PENDING", "remap_pending", "Whether remapping of rows is pending (a reset applies it)"),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "remap_failure", "Whether remapping of rows has failed"),
    ("DCGM_FI_DEV_XID_ERRORS", "last_xid", "Value of the last XID error encountered."),
)

# nvmlClocksEventReason* bit -> the names dcgm-exporter gives them (clock_events_collector.go)
THROTTLE_REASONS = (
    (0x001, "gpu_idle"), (0x002, "clocks_setting"), (0x004, "power_cap"), (0x008, "hw_slowdown"),
    (0x010, "sync_boost"), (0x020, "sw_thermal"), (0x040, "hw_thermal"), (0x080, "hw_power_brake"),
    (0x100, "display_clocks"),
)

LABEL_STYLES = {
    # dcgm-exporter's GPU labels (Hostname as it spells it, so one dashboard serves both), but a snake_case
    # model name: `promtool check metrics` rejects camelCase label names (modelName), not Hostname
    "trainguard": ("gpu", "UUID", "pci_bus_id", "device", "model_name", "Hostname"),
    # exactly dcgm-exporter's GPU template, for dashboards that group by modelName or Hostname
    "dcgm": ("gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname"),
}


@dataclass
class GPU:
    """One GPU as first enumerated: its identity never changes; its handle does, at each NVML re-init."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str
    pci: str                       # xid.pci_key
    handle: Any = None
    lost: bool = False
    lost_reason: str = ""
    recovering: bool = False       # re-initialised after being lost, not yet confirmed by a good reading
    unsupported: set[tuple] = field(default_factory=set)     # (function name, args) it has no answer for
    nvlink_previous: tuple[float, float] | None = None    # (time, TX+RX KiB) for the bandwidth gauge
    pcie_narrow: bool = False       # the last reading's link was narrower than its maximum
    pcie_downgrades: int = 0        # times it went narrow (the trainguard_gpu_pcie_link_downgrades counter)
    gpm_sample: Any = None          # the previous NVML GPM sample (GPM metrics are rates between two samples)

    def labels(self, node: str) -> list[str]:
        return [str(self.index), self.uuid, self.pci_bus_id, f"nvidia{self.index}", self.name, node]


def error_values(nvml, names) -> frozenset[int]:
    return frozenset(getattr(nvml, name) for name in names if hasattr(nvml, name))


class Reader:
    """Reads one GPU; NOT_SUPPORTED-style errors drop the reading, LOST-style and others raise NVMLError."""

    def __init__(self, nvml, pcie_throughput: bool = True):
        self.nvml = nvml
        self.pcie_throughput = pcie_throughput
        self.never = error_values(nvml, NEVER_SUPPORTED)
        self.not_now = error_values(nvml, NOT_NOW)
        self.fields = [(name, getattr(nvml, constant), scope) for name, (constant, scope) in FIELDS.items()
                       if hasattr(nvml, constant)]
        self.field_ids = tuple((fid, scope) for _, fid, scope in self.fields)    # one batched call per GPU
        self._functions: dict[str, Callable | None] = {}     # looked up once (a module attribute never changes)
        # (reading, GPM metric id) of the profiling ratios this pynvml knows (it must know the GPM structs too)
        self.gpm = tuple((dcgm_name, getattr(nvml, metric)) for dcgm_name, metric, _ in GPM_METRICS
                         if hasattr(nvml, metric) and hasattr(nvml, "c_nvmlGpmMetricsGet_t"))
        self.throttle_call = ("nvmlDeviceGetCurrentClocksEventReasons"
                              if hasattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons")
                              else "nvmlDeviceGetCurrentClocksThrottleReasons")

    def call(self, gpu: GPU, name: str, *args: Any) -> Any:
        """nvml.<name>(handle, *args), or None when this GPU has no such reading."""
        key = (name, args)
        if key in gpu.unsupported:
            return None
        function = self._functions.get(name)
        if function is None and name not in self._functions:
            function = self._functions[name] = getattr(self.nvml, name, None)
        if function is None:
            gpu.unsupported.add(key)
            return None
        try:
            return function(gpu.handle, *args)
        except self.nvml.NVMLError as exc:
            if exc.value in self.never:
                gpu.unsupported.add(key)
                return None
            if exc.value in self.not_now:
                return None
            raise

    def read(self, gpu: GPU, now: float) -> dict[str, Any]:
        nvml, r = self.nvml, {}
        util = self.call(gpu, "nvmlDeviceGetUtilizationRates")
        if util is not None:
            r["gpu_util"], r["mem_copy_util"] = util.gpu, util.memory
        memory = self.call(gpu, "nvmlDeviceGetMemoryInfo")
        if memory is not None:
            r.update(mem_used_bytes=memory.used, mem_total_bytes=memory.total, fb_used_mib=memory.used // MiB,
                     fb_free_mib=memory.free // MiB, fb_total_mib=memory.total // MiB)
        _set(r, "gpu_temp_c", self.call(gpu, "nvmlDeviceGetTemperature", nvml.NVML_TEMPERATURE_GPU))
        _set(r, "power_w", self.call(gpu, "nvmlDeviceGetPowerUsage"), per=1000)          # mW -> W
        _set(r, "power_limit_w", self.call(gpu, "nvmlDeviceGetEnforcedPowerLimit"), per=1000)
        _set(r, "energy_mj", self.call(gpu, "nvmlDeviceGetTotalEnergyConsumption"))
        _set(r, "sm_clock_mhz", self.call(gpu, "nvmlDeviceGetClockInfo", nvml.NVML_CLOCK_SM))
        _set(r, "mem_clock_mhz", self.call(gpu, "nvmlDeviceGetClockInfo", nvml.NVML_CLOCK_MEM))
        _set(r, "throttle_reasons", self.call(gpu, self.throttle_call))
        if self.pcie_throughput:   # each call samples the bus for 20 ms
            _set(r, "pcie_tx_kbps", self.call(gpu, "nvmlDeviceGetPcieThroughput", nvml.NVML_PCIE_UTIL_TX_BYTES))
            _set(r, "pcie_rx_kbps", self.call(gpu, "nvmlDeviceGetPcieThroughput", nvml.NVML_PCIE_UTIL_RX_BYTES))
        rows = self.call(gpu, "nvmlDeviceGetRemappedRows")
        if rows is not None:
            (r["remapped_correctable"], r["remapped_uncorrectable"], r["remap_pending"], r["remap_failure"]) = rows
            r["remapped_rows"] = r["remapped_correctable"] + r["remapped_uncorrectable"]
        self._retired_pages(gpu, r)
        self._fields(gpu, r, now)
        self._pcie_link(gpu, r)
        if self.gpm:
            self._gpm(gpu, r)
        processes = self.call(gpu, "nvmlDeviceGetComputeRunningProcesses")
        r["processes"] = [(p.pid, p.usedGpuMemory) for p in processes or () if p.usedGpuMemory is not None]
        return r

    def _retired_pages(self, gpu: GPU, r: dict) -> None:
        nvml = self.nvml
        for name, cause in (("retired_sbe", "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS"),
                            ("retired_dbe", "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR")):
            pages = self.call(gpu, "nvmlDeviceGetRetiredPages", getattr(nvml, cause))
            if pages is not None:
                r[name] = len(pages)
        if "retired_sbe" in r or "retired_dbe" in r:
            r["retired_pages"] = r.get("retired_sbe", 0) + r.get("retired_dbe", 0)
        pending = self.call(gpu, "nvmlDeviceGetRetiredPagesPendingStatus")
        if pending is not None:
            r["retired_pending"] = int(pending)

    def _fields(self, gpu: GPU, r: dict, now: float) -> None:
        values = self.call(gpu, "nvmlDeviceGetFieldValues", self.field_ids)
        for (name, _, _), value in zip(self.fields, values or ()):
            if value.nvmlReturn == self.nvml.NVML_SUCCESS:
                r[name] = field_number(self.nvml, value)
        if "nvlink_crc_flit_errors" in r or "nvlink_crc_data_errors" in r:
            r["nvlink_crc_errors"] = r.get("nvlink_crc_flit_errors", 0) + r.get("nvlink_crc_data_errors", 0)
        if "nvlink_tx_kib" in r and "nvlink_rx_kib" in r:
            total = r["nvlink_tx_kib"] + r["nvlink_rx_kib"]
            before, gpu.nvlink_previous = gpu.nvlink_previous, (now, total)
            if before is not None and now > before[0] and total >= before[1]:
                # DCGM's own conversion (DcgmCacheManager): KiB/s divided by 1000, which DCGM calls MB/s
                r["nvlink_bandwidth"] = (total - before[1]) / (now - before[0]) / 1000.0


    def _pcie_link(self, gpu: GPU, r: dict) -> None:
        """Link generation and width, now and at most; a width below the maximum counts once per time it happens.
        Only width counts as a downgrade: an idle GPU lowers its link generation to save power, by design."""
        for key, name in (("pcie_link_gen", "nvmlDeviceGetCurrPcieLinkGeneration"),
                          ("pcie_max_link_gen", "nvmlDeviceGetMaxPcieLinkGeneration"),
                          ("pcie_link_width", "nvmlDeviceGetCurrPcieLinkWidth"),
                          ("pcie_max_link_width", "nvmlDeviceGetMaxPcieLinkWidth")):
            _set(r, key, self.call(gpu, name))
        if "pcie_link_width" in r and "pcie_max_link_width" in r:
            narrow = 0 < r["pcie_link_width"] < r["pcie_max_link_width"]
            if narrow and not gpu.pcie_narrow:
                gpu.pcie_downgrades += 1
            gpu.pcie_narrow = narrow
            r["pcie_downgrades"] = gpu.pcie_downgrades

    def _gpm(self, gpu: GPU, r: dict) -> None:
        """DCGM's profiling ratios from two NVML GPM samples (this update's and the last one's); none on a GPU
        without GPM (before Hopper), and none at the first update (a rate needs two samples)."""
        nvml = self.nvml
        support = self.call(gpu, "nvmlGpmQueryDeviceSupport")
        if support is None or not support.isSupportedDevice:
            gpu.unsupported.add(("nvmlGpmQueryDeviceSupport", ()))     # not asked again until a re-init
            return
        sample = nvml.nvmlGpmSampleAlloc()
        try:
            nvml.nvmlGpmSampleGet(gpu.handle, sample)
        except nvml.NVMLError as exc:
            _free_gpm(nvml, sample)
            if exc.value in self.never or exc.value in self.not_now:
                return
            raise
        previous, gpu.gpm_sample = gpu.gpm_sample, sample
        if previous is None:
            return
        request = nvml.c_nvmlGpmMetricsGet_t()
        request.version, request.numMetrics = nvml.NVML_GPM_METRICS_GET_VERSION, len(self.gpm)
        request.sample1, request.sample2 = previous, sample
        for slot, (_, metric_id) in enumerate(self.gpm):
            request.metrics[slot].metricId = metric_id
        try:
            answer = nvml.nvmlGpmMetricsGet(request)
        except nvml.NVMLError as exc:
            if exc.value in self.never or exc.value in self.not_now:
                return
            raise
        finally:
            _free_gpm(nvml, previous)
        for slot, (key, _) in enumerate(self.gpm):
            metric = answer.metrics[slot]
            if metric.nvmlReturn == nvml.NVML_SUCCESS:
                r[key] = metric.value / 100.0


def _free_gpm(nvml, sample: Any) -> None:
    try:
        nvml.nvmlGpmSampleFree(sample)
    except nvml.NVMLError:
        pass      # a sample of a shut-down NVML went with it


def _set(r: dict, key: str, value: Any, per: int = 1) -> None:
    if value is not None:
        r[key] = value / per if per != 1 else value


def field_number(nvml, value) -> float:
    return getattr(value.value, _value_members(nvml).get(value.valueType, "ullVal"))


@lru_cache(maxsize=8)
def _value_members(nvml) -> dict[int, str]:
    """nvmlValueType_t -> the member of the value union holding it (made once per NVML module: 15 fields per GPU)."""
    return {nvml.NVML_VALUE_TYPE_DOUBLE: "dVal", nvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
            nvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal", nvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
            nvml.NVML_VALUE_TYPE_SIGNED_INT: "siVal", getattr(nvml, "NVML_VALUE_TYPE_UNSIGNED_SHORT", -1): "usVal"}


# ------------------------------------------------------------------------------------------ rendering

# (trainguard name, reading, scale, help) -> one counter per GPU
COUNTERS = (
    ("trainguard_gpu_nvlink_transmitted_bytes", "nvlink_tx_kib", 1024, "NVLink data transmitted over all links."),
    ("trainguard_gpu_nvlink_received_bytes", "nvlink_rx_kib", 1024, "NVLink data received over all links."),
    ("trainguard_gpu_pcie_transmitted_bytes", "pcie_tx_bytes", 1, "Bytes the GPU transmitted over PCIe."),
    ("trainguard_gpu_pcie_received_bytes", "pcie_rx_bytes", 1, "Bytes the GPU received over PCIe."),
    # DCGM_FI_DEV_PCIE_REPLAY_COUNTER: promtool rejects a metric name containing "counter"
    ("trainguard_gpu_pcie_replays", "pcie_replays", 1, "PCIe replays (retries) of the GPU's link."),
    # the health counters again as counters (DCGM's names are gauges here, see the module doc), so rate() and
    # increase() are what they mean; the node-risk rule and the hardware alerts read these
    ("trainguard_gpu_ecc_correctable_errors", "ecc_sbe_volatile", 1,
     "Corrected (single-bit) ECC errors since the driver loaded."),
    ("trainguard_gpu_ecc_uncorrectable_errors", "ecc_dbe_volatile", 1,
     "Uncorrectable (double-bit) ECC errors since the driver loaded."),
    ("trainguard_gpu_retired_pages", "retired_pages", 1, "Memory pages retired (single- and double-bit causes)."),
    ("trainguard_gpu_remapped_rows", "remapped_rows", 1, "Memory rows remapped (correctable and uncorrectable)."),
    ("trainguard_gpu_nvlink_crc_errors", "nvlink_crc_errors", 1, "NVLink CRC errors (flit and data), all links."),
    ("trainguard_gpu_nvlink_replay_errors", "nvlink_replay_errors", 1, "NVLink replays (retries), all links."),
    ("trainguard_gpu_power_slowdown_seconds", "power_violation_ns", 1e-9,
     "Time the clocks were held down by the power policy."),
    ("trainguard_gpu_thermal_slowdown_seconds", "thermal_violation_ns", 1e-9,
     "Time the clocks were held down by the thermal policy."),
    ("trainguard_gpu_pcie_link_downgrades", "pcie_downgrades", 1,
     "Times the PCIe link went narrower than its maximum width (the agent's first reading counts "
     "when it already is)."),
)


def families(gpus: list[GPU], readings: dict[int, dict], xid_counts: dict[tuple[str, int], int],
             ranks_by_pid: dict[int, int], node: str, label_names: tuple[str, ...],
             xid_sources: dict[str, bool]) -> list[Metric]:
    """All GPU families from one update's readings ({gpu index: reading}); lost GPUs have no reading."""
    return _families_of(tuple(label_names)).build(gpus, readings, xid_counts, ranks_by_pid, node, xid_sources)


@lru_cache(maxsize=None)
def _families_of(label_names: tuple[str, ...]) -> "_Families":
    return _Families(label_names)


class _Families:
    """The GPU families of one label style: names checked once, each label set made once (per GPU, reason ...)."""

    def __init__(self, label_names: tuple[str, ...]):
        labels = list(label_names)
        # (spec, reading, scale): one sample per GPU that has the reading
        self.per_gpu = [(Spec("gauge", name, help_, labels), key, 1) for name, key, help_ in DCGM_GAUGES]
        self.per_gpu += [(Spec("gauge", name, help_, labels), name, 1) for name, _, help_ in GPM_METRICS]
        self.counters = [(Spec("counter", name, help_, labels), key, scale) for name, key, scale, help_ in COUNTERS]
        self.lost = Spec("gauge", "trainguard_gpu_lost", "1 while NVML reports the GPU lost (fell off the bus, "
                         "driver wedged) or cannot reach it; NVML is re-initialised with backoff.", labels)
        self.throttle = Spec("gauge", "trainguard_gpu_clock_throttle_active", "1 while this clock throttle reason "
                             "is active (DCGM_FI_DEV_CLOCKS_EVENT_REASONS decoded).", [*labels, "reason"])
        self.xid_errors = Spec("counter", "trainguard_gpu_xid_errors", "XID errors by code and NVIDIA catalogue "
                               "class, from NVML events and the kernel log (the larger count of the two); the codes "
                               "that matter exist at 0 from the agent's start.", [*labels, "xid", "xid_class"])
        self.xid_available = Spec("gauge", "trainguard_gpu_xid_source_available", "1 if this XID source (nvml "
                                  "events, kmsg) is readable here.", ["source"])
        self.processes = Spec("gauge", "trainguard_gpu_process_memory_bytes", "GPU memory used by the trainer's "
                              "ranks on this GPU (rank \"other\": processes that are no rank of the run).",
                              [*labels, "rank"])
        self.gpu_labels = LabelCache(labels)
        self.throttle_labels = LabelCache(self.throttle.label_names)
        self.xid_labels = LabelCache(self.xid_errors.label_names)
        self.source_labels = LabelCache(["source"])
        self.rank_labels = LabelCache(self.processes.label_names)

    def build(self, gpus: list[GPU], readings: dict[int, dict], xid_counts: dict[tuple[str, int], int],
              ranks_by_pid: dict[int, int], node: str, xid_sources: dict[str, bool]) -> list[Metric]:
        values = {gpu.index: tuple(gpu.labels(node)) for gpu in gpus}      # each GPU's label values
        # (label values, label set, reading) of every GPU read in this update
        read = [(values[gpu.index], self.gpu_labels.get(*values[gpu.index]), readings[gpu.index])
                for gpu in gpus if gpu.index in readings]
        out = self._per_gpu(self.per_gpu, read)
        out.append(self.lost.family((self.gpu_labels.get(*values[gpu.index]), 1 if gpu.lost else 0) for gpu in gpus))
        throttle = self._throttle(read)
        if throttle.samples:
            out.append(throttle)
        out += self._per_gpu(self.counters, read)
        out += self._xid_families(gpus, values, xid_counts, node, xid_sources)
        processes = self._process_family(read, ranks_by_pid)
        return out + [processes] if processes.samples else out

    @staticmethod
    def _per_gpu(specs: list[tuple[Spec, str, int]], read: list[tuple]) -> list[Metric]:
        """A family per spec with the GPUs that have its reading; a reading no GPU has gives no family."""
        out = []
        for spec, key, scale in specs:
            samples = [(labels, reading[key] * scale) for _, labels, reading in read if key in reading]
            if samples:
                out.append(spec.family(samples))
        return out

    def _throttle(self, read: list[tuple]) -> Metric:
        samples = []
        for gpu_values, _, reading in read:
            reasons = reading.get("throttle_reasons")
            if reasons is not None:
                samples += [(self.throttle_labels.get(*gpu_values, reason), 1 if reasons & bit else 0)
                            for bit, reason in THROTTLE_REASONS]
        return self.throttle.family(samples)

    def _xid_families(self, gpus: list[GPU], values: dict[int, tuple], counts: dict[tuple[str, int], int],
                      node: str, sources: dict[str, bool]) -> list[Metric]:
        by_pci = {gpu.pci: values[gpu.index] for gpu in gpus}
        # every GPU's watched codes at 0 (a lost GPU's too: its XID 79 is the one that matters), then the counts
        totals = {(gpu.pci, xid): 0 for gpu in gpus if gpu.pci for xid in xid_catalog.WATCHED}
        totals.update(counts)
        samples = []
        for (pci, xid), count in sorted(totals.items()):
            gpu_values = by_pci.get(pci) or ("", "", pci, "", "", node)    # a PCI address NVML does not list
            samples.append((self.xid_labels.get(*gpu_values, str(xid), xid_catalog.class_of(xid)), count))
        errors = self.xid_errors.family(samples)
        available = self.xid_available.family((self.source_labels.get(source), 1 if ok else 0)
                                              for source, ok in sorted(sources.items()))
        return [f for f in (errors, available) if f.samples]

    def _process_family(self, read: list[tuple], ranks_by_pid: dict[int, int]) -> Metric:
        samples = []
        for gpu_values, _, reading in read:
            per_rank: dict[str, int] = {}
            for pid, used in reading.get("processes", ()):
                rank = str(ranks_by_pid[pid]) if pid in ranks_by_pid else "other"
                per_rank[rank] = per_rank.get(rank, 0) + used
            samples += [(self.rank_labels.get(*gpu_values, rank), used) for rank, used in sorted(per_rank.items())]
        return self.processes.family(samples)
