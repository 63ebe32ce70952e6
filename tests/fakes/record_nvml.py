"""Records what NVML answers on a GPU node as a scenario for the fake NVML (tests/fakes/fake_nvml.py).

    python -m tests.fakes.record_nvml --out tests/fakes/nvml/h200x8.json --updates 3 --interval 5

It runs the gpu collector itself against the real pynvml through a recording proxy, so the scenario holds
exactly the calls the collector makes, with its arguments, and NVML's answers or errors. Calls made while the
collector starts go to each device's "static" answers, those of each update to a sample (each sample after
the first keeps only what changed); XIDs that NVML delivers become the sample's "xid_events".
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

from trainguard.agent.collector import CollectorDisabled, Context
from trainguard.agent.collectors.gpu import GPUCollector
from trainguard.metrics.gpu_metrics import field_number

from .fake_nvml import FORMAT

# Calls the fake answers by itself (handles, counts, event plumbing); only their errors are worth keeping.
NOT_RECORDED = {"nvmlInit", "nvmlShutdown", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex",
                "nvmlDeviceGetHandleByUUID", "nvmlDeviceGetIndex", "nvmlEventSetCreate", "nvmlEventSetFree",
                "nvmlDeviceRegisterEvents", "nvmlEventSetWait", "nvmlEventSetWait_v2", "nvmlGpmSampleAlloc",
                "nvmlGpmSampleFree", "nvmlGpmSampleGet", "nvmlGpmMetricsGet"}


def to_json(value: Any) -> Any:
    """pynvml's answers (ctypes structs, friendly objects, bytes) as JSON values the fake turns back into them."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, (list, tuple)):
        return [to_json(item) for item in value]
    if isinstance(value, ctypes.Structure):
        return {name: to_json(getattr(value, name)) for name, *_ in value._fields_}
    if isinstance(value, ctypes._SimpleCData):
        return to_json(value.value)
    if hasattr(value, "__dict__"):
        return {key: to_json(item) for key, item in vars(value).items() if not key.startswith("_")}
    raise TypeError(f"cannot record {type(value).__name__}: {value!r}")


def _address(pointer: Any) -> int:
    """The address a ctypes pointer (an NVML GPM sample) points at: the same sample read back from a struct.
    A sample that is no ctypes pointer (the fake's, when the recorder is tested over it) is itself."""
    if isinstance(pointer, ctypes._Pointer):
        return ctypes.cast(pointer, ctypes.c_void_p).value or 0
    return id(pointer)


class Recorder:
    """Stands in for the pynvml module: forwards every call and keeps its answer, per device and phase."""

    def __init__(self, nvml):
        self._nvml = nvml
        self.init_error: str | None = None
        self.system: dict = {}
        self.static: dict[int, dict] = {}
        self.samples: list[dict[int, dict]] = []
        self._gpm_devices: dict[int, int] = {}      # a GPM sample's address -> the device it was taken on

    def begin_sample(self) -> None:
        self.samples.append({})

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._nvml, name)
        if name.startswith("nvml") and callable(value) and not isinstance(value, type):
            return lambda *args: self._call(name, value, args)
        return value

    def _call(self, name: str, function, args: tuple) -> Any:
        try:
            result = function(*args)
        except self._nvml.NVMLError as exc:
            self._keep(name, args, {"error": self._error_name(exc.value)}, failed=True)
            raise
        self._keep(name, args, result, failed=False)
        return result

    def _keep(self, name: str, args: tuple, result: Any, failed: bool) -> None:
        nvml = self._nvml
        if name == "nvmlInit":
            self.init_error = result["error"] if failed else None
        elif name in ("nvmlEventSetWait", "nvmlEventSetWait_v2"):
            if not failed and self.samples:
                index = nvml.nvmlDeviceGetIndex(result.device)
                self.samples[-1].setdefault(index, {}).setdefault("xid_events", []).append(int(result.eventData))
        elif name == "nvmlGpmSampleGet":
            self._gpm_devices[_address(args[1])] = nvml.nvmlDeviceGetIndex(args[0])
        elif name == "nvmlGpmMetricsGet" and not failed and self.samples:
            index = self._gpm_devices.get(_address(result.sample2))
            if index is not None:
                answers = {str(m.metricId): m.value for m in result.metrics[:result.numMetrics]
                           if m.nvmlReturn == nvml.NVML_SUCCESS}
                self.samples[-1].setdefault(index, {})[name] = answers
        elif name == "nvmlDeviceRegisterEvents":
            if failed:
                self.static.setdefault(nvml.nvmlDeviceGetIndex(args[0]), {})[name] = result
        elif name.startswith("nvmlSystem"):
            self.system[name] = to_json(result)
        elif name not in NOT_RECORDED and (name.startswith("nvmlDevice") or name == "nvmlGpmQueryDeviceSupport"):
            index = nvml.nvmlDeviceGetIndex(args[0])
            table = (self.samples[-1] if self.samples else self.static).setdefault(index, {})
            if name == "nvmlDeviceGetFieldValues":
                table[name] = {**table.get(name, {}), **self._fields(args[1], result, failed)}
            else:
                key = name + (f"({','.join(str(a) for a in args[1:])})" if len(args) > 1 else "")
                table[key] = result if failed else to_json(result)

    def _fields(self, requested: list, result: Any, failed: bool) -> dict:
        nvml, out = self._nvml, {}
        for position, field in enumerate(requested):
            field_id, scope = field if isinstance(field, tuple) else (field, 0)
            key = f"{field_id}:{scope}"
            if failed:
                out[key] = result
                continue
            entry = result[position]
            if entry.nvmlReturn != nvml.NVML_SUCCESS:
                out[key] = {"error": self._error_name(entry.nvmlReturn)}
            else:     # decoded as the collector decodes it; the fake stores ints as unsigned long long
                number = field_number(nvml, entry)
                out[key] = float(number) if entry.valueType == nvml.NVML_VALUE_TYPE_DOUBLE else int(number)
        return out

    def _error_name(self, value: int) -> str:
        names = [n for n in dir(self._nvml) if n.startswith("NVML_ERROR_") and getattr(self._nvml, n) == value]
        return names[0] if names else "NVML_ERROR_UNKNOWN"

    def scenario(self, origin: str) -> dict:
        spec: dict = {"format": FORMAT, "origin": origin, "system": self.system}
        if self.init_error:
            spec["init"] = {"error": self.init_error}
        indices = sorted(set(self.static) | {i for sample in self.samples for i in sample})
        spec["devices"] = [{"static": self.static.get(i, {}), "samples": self._samples_of(i)} for i in indices]
        return spec

    def _samples_of(self, index: int) -> list[dict]:
        out, previous = [], {}
        for number, sample in enumerate(self.samples):
            current = {**{k: v for k, v in previous.items() if k != "xid_events"}, **sample.get(index, {})}
            out.append(current if number == 0 else {k: v for k, v in current.items() if previous.get(k) != v})
            previous = current
        return out or [{}]


def record(nvml, updates: int, interval: float, advance=None, context: Context | None = None) -> Recorder:
    """Run the gpu collector `updates` times over `nvml` through a Recorder; `advance()` runs between updates."""
    recorder = Recorder(nvml)
    ctx = context or Context(node=socket.gethostname())
    ctx = Context(procfs=ctx.procfs, sysfs=ctx.sysfs, devfs=ctx.devfs, run_dir=ctx.run_dir, node=ctx.node,
                  options={**ctx.options, "nvml_module": recorder, "kmsg": False})
    try:
        collector = GPUCollector(ctx)
    except CollectorDisabled:
        return recorder
    try:
        for number in range(updates):
            if number:
                time.sleep(interval)
                if advance:
                    advance()
            recorder.begin_sample()
            collector.update()
    finally:
        collector.close()
    return recorder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="scenario file to write")
    parser.add_argument("--updates", type=int, default=3, help="collector updates to record (samples)")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between updates")
    args = parser.parse_args(argv)
    import pynvml

    recorder = record(pynvml, args.updates, args.interval)
    driver = recorder.system.get("nvmlSystemGetDriverVersion", "no driver")
    origin = (f"Recorded by tests/fakes/record_nvml.py on {socket.gethostname()} at "
              f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M:%SZ} (driver {driver}), "
              f"{args.updates} updates {args.interval:g} s apart.")
    args.out.write_text(json.dumps(recorder.scenario(origin), indent=1) + "\n")
    print(f"{args.out}: {len(recorder.static)} GPUs, {len(recorder.samples)} samples", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
