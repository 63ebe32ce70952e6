"""Step telemetry: one TLS v1 record per step per rank, from any training loop.

    from trainguard.runtime.telemetry import StepTelemetry, StepTimer

    telemetry = StepTelemetry(run_dir, rank=rank, world_size=world, run_id="exp1",
                              flops_per_token=model.flops_per_token())   # peak: runtime/mfu.py
    timer = StepTimer()
    for step in range(1, steps + 1):
        timer.start()
        x, y = next(batches);                   timer.mark("data_wait")
        loss = model(x, y)[1]; loss.backward(); timer.mark("forward_backward")
        norm = clip_grad_norm_(params, 1.0)
        optimizer.step(); optimizer.zero_grad(); timer.mark("optimizer")
        telemetry.step(step, loss=loss, grad_norm=norm, learning_rate=lr,
                       tokens=x.numel(), samples=len(x), timings=timer.stop())

Values may be floats or 0-d tensors: every tensor handed to one `step()` call is stacked and copied to
the host with a single ``.tolist()``, so telemetry costs at most one device-to-host sync per step (the
bundled trainer hands over host floats it already has, and costs none). Records go to
``RUN/tls/rank-<r>.jsonl`` through `trainguard.tls.Writer`, one ``os.write`` each.

Throughput and token counters are this rank's; loss, gradient norms and learning rate are the global
values the loop passes. `event()` writes decision and lifecycle events; they are an audit log and are
written even when step records are turned off (``enabled=False``, the ``--telemetry off`` baseline).

MFU (``metrics.mfu``) is written only when both halves are known: the model's training FLOPs per token
(`flops_per_token`, the user's figure for their model) and the device's peak (`peak_flops`, else
runtime/mfu.py's documented table by GPU model for `precision`). Otherwise it is left out and
`mfu_unavailable` says why (the trainer records it in `run_start`; the report shows "n/a" with it).
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any, Callable

from trainguard import rundir
from trainguard import tls
from trainguard.runtime import mfu as mfu_mod

try:
    import torch
except ImportError:  # the library also serves loops that hand over plain floats
    torch = None


class StepTimer:
    """Host-side phase timer: `mark(phase)` charges the time since the last mark to `phase`."""

    __slots__ = ("_start", "_last", "phases")

    def __init__(self):
        self._start = self._last = 0.0
        self.phases: dict[str, float] = {}

    def start(self) -> None:
        self._start = self._last = time.perf_counter()
        self.phases = {}

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._last
        self._last = now

    def stop(self) -> dict[str, float]:
        """Phase durations in seconds, keyed ``<phase>_seconds``, plus ``step_time_seconds``."""
        out = {f"{name}_seconds": seconds for name, seconds in self.phases.items()}
        out["step_time_seconds"] = time.perf_counter() - self._start
        return out


class CommTimer:
    """A DDP communication hook that all-reduces gradient buckets and times each all-reduce.

    `ddp.register_comm_hook(None, timer.hook)`; after the step's host sync, `take()` returns the seconds
    spent in gradient all-reduce since the last call. On CPU (gloo) the end is stamped by the future's
    callback; on GPU (NCCL) by CUDA events on the stream, read only once the step has synced, so the
    timer adds no synchronisation of its own.
    """

    def __init__(self, device_type: str = "cpu"):
        self.cuda = device_type == "cuda"
        self._spans: list = []

    def hook(self, state, bucket):   # unannotated: DDP rejects annotations it cannot resolve
        import torch.distributed as dist

        tensor = bucket.buffer()
        tensor.div_(dist.get_world_size())
        start = self._stamp()
        future = dist.all_reduce(tensor, async_op=True).get_future()

        def finished(fut):
            self._spans.append((start, self._stamp()))
            return fut.value()[0]

        return future.then(finished)

    def _stamp(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def take(self) -> float:
        spans, self._spans = self._spans, []
        if self.cuda:
            return sum(a.elapsed_time(b) for a, b in spans if b.query()) / 1e3
        return sum(b - a for a, b in spans)


class MemoryProbe:
    """Memory of this process without a device sync: the CUDA caching allocator's counters on GPU
    (plain host counters), resident set size on CPU.

    RSS takes a system call (a pread of /proc/self/statm), so it is read at most every RSS_INTERVAL
    seconds and reused in between: it moves slowly, and the syscall is the largest single cost of a
    record on a busy CPU.
    """

    RSS_INTERVAL = 0.5

    def __init__(self, device_type: str):
        self.cuda = device_type == "cuda"
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        try:
            self._statm = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            self._statm = -1
        self._rss: dict[str, int] = {}
        self._rss_at = -self.RSS_INTERVAL

    def read(self) -> dict[str, int]:
        if self.cuda:
            return {"mem_allocated_bytes": torch.cuda.memory_allocated(),
                    "mem_reserved_bytes": torch.cuda.memory_reserved(),
                    "mem_peak_bytes": torch.cuda.max_memory_allocated()}
        now = time.monotonic()
        if now - self._rss_at >= self.RSS_INTERVAL:
            self._rss, self._rss_at = {"rss_bytes": self._read_rss()}, now
        return dict(self._rss)

    def _read_rss(self) -> int:
        if self._statm >= 0:
            return int(os.pread(self._statm, 128, 0).split()[1]) * self._page
        import psutil

        return psutil.Process().memory_info().rss

    def close(self) -> None:
        if self._statm >= 0:
            os.close(self._statm)
            self._statm = -1


class EnergyProbe:
    """This rank's GPU energy counter (NVML's `nvmlDeviceGetTotalEnergyConsumption`, mJ since the driver
    loaded) as ``hardware.energy_joules`` in each step record: joules per GPU per step are the difference of
    two records, and the cost meter's energy budget reads it (trainguard/decide/cost.py). Nothing on a CPU
    run, on a GPU without the counter (pre-Volta) or without NVML: the probe switches itself off, once."""

    def __init__(self, device_type: str, device_index: int | None = None, nvml: Any = None):
        self.handle = None
        self.nvml = nvml
        if device_type != "cuda" and nvml is None:
            return
        try:
            if self.nvml is None:
                import pynvml as loaded

                self.nvml = loaded
            self.nvml.nvmlInit()
            self.handle = self._handle(device_index)
            self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
        except Exception:      # no driver, no counter, no such device: records carry no energy
            self.handle = None

    def _handle(self, index: int | None) -> Any:
        """By the CUDA device's UUID (NVML's index differs from CUDA's under CUDA_VISIBLE_DEVICES)."""
        if torch is not None and torch.cuda.is_available() and index is not None:
            uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
            if uuid is not None:
                return self.nvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        return self.nvml.nvmlDeviceGetHandleByIndex(index or 0)

    def read(self) -> dict[str, float]:
        if self.handle is None:
            return {}
        try:
            return {"energy_joules": self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1000.0}
        except Exception:
            self.handle = None
            return {}


def _has_tensor(values: dict[str, Any]) -> bool:
    if torch is None:
        return False
    tensor = torch.Tensor
    for value in values.values():
        if isinstance(value, tensor) or value.__class__ is dict and any(
                isinstance(item, tensor) for item in value.values()):
            return True
    return False


def _host_values(values: dict[str, Any]) -> dict[str, Any]:
    """Replace every tensor among `values` (and inside dict values) by a float, with one .tolist()."""
    if torch is None:
        return values
    where, tensors = [], []
    for key, value in values.items():
        if isinstance(value, torch.Tensor):
            where.append((key, None))
            tensors.append(value)
        elif isinstance(value, dict):
            for sub, item in value.items():
                if isinstance(item, torch.Tensor):
                    where.append((key, sub))
                    tensors.append(item)
    if not tensors:
        return values
    floats = torch.stack([t.detach().float().reshape(()) for t in tensors]).tolist()
    out = {key: dict(value) if isinstance(value, dict) else value for key, value in values.items()}
    for (key, sub), number in zip(where, floats):
        if sub is None:
            out[key] = number
        else:
            out[key][sub] = number
    return out


class StepTelemetry:
    """Writes one TLS record per `step()` to ``RUN/tls/rank-<rank>.jsonl``."""

    def __init__(self, run_dir: str | os.PathLike, *, rank: int = 0, world_size: int = 1,
                 run_id: str | None = None, node: str | None = None, device_type: str = "cpu",
                 gpu_count: int | None = None, flops_per_token: float = 0.0, peak_flops: float = 0.0,
                 precision: str = "bf16", device_name: str | None = None, enabled: bool = True,
                 device_index: int | None = None, nvml: Any = None):
        """`flops_per_token`: training FLOPs per token of the model (6N plus attention for a GPT; 0: unknown,
        no MFU). `peak_flops`: the device's peak FLOP/s (0: runtime/mfu.py's table for `precision` and the
        CUDA device's name, `device_name` or ``torch.cuda.get_device_name()``). `device_index`: this rank's
        CUDA device, whose NVML energy counter each record carries (`nvml`: a pynvml-like module, for tests)."""
        for name, value in (("flops_per_token", flops_per_token), ("peak_flops", peak_flops)):
            if not (isinstance(value, (int, float)) and value >= 0 and value != float("inf")):
                raise ValueError(f"StepTelemetry: {name} must be a finite number, 0 or more, not {value!r}")
        self.path = rundir.rank_log(run_dir, rank)
        self.writer = tls.Writer(self.path)
        self.enabled = enabled
        if device_name is None:
            device_name = torch.cuda.get_device_name() if device_type == "cuda" and torch is not None else ""
        self.device_name = device_name
        self.peak = mfu_mod.peak_flops(device_type, device_name, precision, peak_flops)
        self.flops_per_token = float(flops_per_token)
        self.peak_flops = self.peak.flops or 0.0
        self.mfu_unavailable = self.peak.reason or (
            "" if self.flops_per_token else "no model FLOPs per token given (flops_per_token)")
        self.memory = MemoryProbe(device_type)
        self.energy = EnergyProbe(device_type, device_index, nvml) if enabled else EnergyProbe("cpu")
        self.envelope = {"run_id": run_id or Path(run_dir).name, "node": node or socket.gethostname(),
                         "rank": rank}
        if gpu_count is None:
            gpu_count = world_size if device_type == "cuda" else 0
        self.system: dict[str, Any] = {"gpu_count": gpu_count, "world_size": world_size}
        self.last_checkpoint: str | None = None
        # Called with every record written (step and event): the checkpoint autopilot measures from them.
        self.observers: list[Callable[[dict], None]] = []

    def mfu_basis(self) -> dict[str, Any]:
        """What MFU divides by, for a `run_start` event: the peak, where it came from, the FLOPs per token,
        and `mfu_unavailable` (why there is no MFU) when there is none."""
        basis = {"peak_flops": self.peak.flops, "peak_flops_source": self.peak.source,
                 "flops_per_token": self.flops_per_token}
        if self.mfu_unavailable:
            basis["mfu_unavailable"] = self.mfu_unavailable
        return basis

    def step(self, step: int, *, loss: Any, timings: dict[str, float], tokens: int, samples: int,
             grad_norm: Any = None, grad_norm_by_layer: dict | None = None, learning_rate: Any = None,
             tokens_trained: int | None = None, tokens_loaded: int | None = None,
             timestamp: float | None = None, **extra: Any) -> dict | None:
        """Write this step's record (and return it); None when telemetry is off."""
        if not self.enabled:
            return None
        metrics = {"loss": loss, "grad_norm": grad_norm, "learning_rate": learning_rate,
                   "grad_norm_by_layer": grad_norm_by_layer, **extra}
        if _has_tensor(metrics):
            metrics = _host_values(metrics)
        for key in [key for key, value in metrics.items() if value is None]:
            del metrics[key]
        metrics.update(timings)
        seconds = timings["step_time_seconds"]
        tokens_per_second = tokens / seconds if seconds > 0 else 0.0
        metrics["tokens_per_second"] = tokens_per_second
        metrics["samples_per_second"] = samples / seconds if seconds > 0 else 0.0
        if not self.mfu_unavailable:
            metrics["mfu"] = mfu_mod.mfu(self.flops_per_token, tokens_per_second, self.peak_flops)
        if tokens_trained is not None:
            metrics["tokens_trained"] = tokens_trained
        if tokens_loaded is not None:
            metrics["tokens_loaded"] = tokens_loaded
        # The monotonic clock beside the wall time: the cost meter bills by it, so an NTP step of the wall
        # clock is not spend (trainguard/decide/cost.py).
        system = {**self.system, "monotonic_seconds": time.monotonic()}
        if self.last_checkpoint is not None:
            system["last_checkpoint"] = self.last_checkpoint
        if self.writer.dropped:      # records a full disk cost this rank so far (tls.Writer drops, never stops)
            system["tls_records_dropped"] = self.writer.dropped
        record = {"schema": tls.SCHEMA_ID,
                  "timestamp": tls.format_timestamp(time.time() if timestamp is None else timestamp),
                  **self.envelope, "step": step, "metrics": metrics,
                  "hardware": {**self.memory.read(), **self.energy.read()}, "system": system}
        self.writer.write(record)
        self._tell(record)
        return record

    def event(self, kind: str, /, step: int | None = None, **fields: Any) -> dict:
        """Write an event record (``{"type": kind, ...}``); `step` goes in the envelope and the event."""
        body = {"type": kind, **fields}
        if step is not None:
            body["step"] = step
        record = {"schema": tls.SCHEMA_ID, "timestamp": tls.format_timestamp(time.time()),
                  **self.envelope}
        if step is not None:
            record["step"] = step
        record["event"] = body
        self.writer.write(record)
        self._tell(record)
        return record

    def _tell(self, record: dict) -> None:
        for observer in self.observers:
            observer(record)

    def close(self) -> None:
        self.writer.close()
        self.memory.close()
