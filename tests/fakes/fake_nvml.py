"""A FAKE of the `pynvml` module, replaying recorded NVML answers: the one fake trainguard's tests allow.

Machines without a GPU (CI, laptops) drive the GPU collector through this module. It has pynvml's function
names and signatures, and pynvml's own constants and NVMLError classes (re-exported, so the collector's
`except nvml.NVMLError` and `exc.value == nvml.NVML_ERROR_GPU_IS_LOST` mean the same on both). Its answers come
from a scenario file under tests/fakes/nvml/, in the format tests/fakes/record_nvml.py writes on a GPU node:

    {"format": "trainguard-fake-nvml/1",
     "origin": "how the values were obtained",
     "init": {"error": "NVML_ERROR_LIBRARY_NOT_FOUND"},        # optional: nvmlInit raises this
     "system": {"nvmlSystemGetDriverVersion": "550.90.07"},
     "devices": [{"static": {"nvmlDeviceGetUUID": "GPU-...", ...},
                  "samples": [{"<call>": <answer>, ...}, {<only what changed>}, ...]}]}

A call is keyed by its name plus the arguments after the handle, "nvmlDeviceGetClockInfo(1)"; "*" stands for
any first argument. An answer is a JSON value (objects become attribute objects, like pynvml's structs), or
{"error": "NVML_ERROR_NOT_SUPPORTED"} to raise that error. nvmlDeviceGetFieldValues answers per
"fieldId:scopeId" (a field it lacks answers NOT_SUPPORTED in its entry, as NVML does). Two sample keys are no
calls: "lost": true makes every call on the device raise GPU_IS_LOST while the fake is at that sample, and
"xid_events": [79, ...] are delivered to the event sets registered for XIDs when the fake reaches the sample.

    nvml = FakeNVML("h100x8")          # a test: pass it as the gpu collector's `nvml_module` option
    nvml.advance()                     # next sample, between two updates

In an agent process, set TRAINGUARD_FAKE_NVML=<scenario name or path> (and optionally
TRAINGUARD_FAKE_NVML_STEP_S=<seconds per sample>) and the gpu option `nvml_module: tests.fakes.fake_nvml`:
the module itself then answers as pynvml does.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter, deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml

FORMAT = "trainguard-fake-nvml/1"
SCENARIOS = Path(__file__).with_name("nvml")
UINT_MAX = 0xFFFFFFFF

# pynvml's constants and error classes: the very same objects, so the fake cannot drift from the real values.
_EXPORTED = ("NVML_", "NVMLError", "nvmlEventType", "nvmlClocksEventReason", "nvmlClocksThrottleReason")
CONSTANTS = {name: getattr(pynvml, name) for name in dir(pynvml) if name.startswith(_EXPORTED)}
globals().update(CONSTANTS)
NVMLError = pynvml.NVMLError

# Calls answered from a device's recorded values: (handle, *args) -> the answer for "name(args)".
DEVICE_CALLS = (
    "nvmlDeviceGetUUID", "nvmlDeviceGetName", "nvmlDeviceGetPciInfo", "nvmlDeviceGetMinorNumber",
    "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetTemperature",
    "nvmlDeviceGetPowerUsage", "nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetTotalEnergyConsumption",
    "nvmlDeviceGetClockInfo", "nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetPcieThroughput", "nvmlDeviceGetRemappedRows", "nvmlDeviceGetRetiredPages",
    "nvmlDeviceGetRetiredPagesPendingStatus", "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkGeneration", "nvmlDeviceGetCurrPcieLinkWidth",
    "nvmlDeviceGetMaxPcieLinkWidth", "nvmlGpmQueryDeviceSupport",
)


class ScenarioError(ValueError):
    """A scenario file that is not in the recorded format, or lacks an answer the code under test asked for."""


def _error(name: str) -> NVMLError:
    if name not in CONSTANTS or not name.startswith("NVML_ERROR_"):
        raise ScenarioError(f"unknown NVML error {name!r}")
    return NVMLError(CONSTANTS[name])


def _answer(value: Any) -> Any:
    """JSON -> what pynvml returns: attribute objects for structs, lists of them, plain values."""
    if isinstance(value, dict):
        if set(value) == {"error"}:
            raise _error(value["error"])
        return SimpleNamespace(**{key: _answer(item) for key, item in value.items()})
    if isinstance(value, list):
        return [_answer(item) for item in value]
    return value


class FakeHandle:
    """What nvmlDeviceGetHandle* returns; it goes stale when NVML is shut down, as the real handles do."""

    __slots__ = ("index", "generation")

    def __init__(self, index: int, generation: int):
        self.index, self.generation = index, generation

    def __repr__(self) -> str:
        return f"<fake nvmlDevice {self.index} gen {self.generation}>"


class _EventSet:
    def __init__(self, generation: int):
        self.generation = generation
        self.devices: dict[int, int] = {}     # device index -> registered event mask
        self.queue: deque = deque()


class _Device:
    def __init__(self, index: int, spec: dict, source: str):
        where = f"{source}: devices[{index}]"
        if not isinstance(spec.get("static"), dict) or not spec.get("samples"):
            raise ScenarioError(f"{where}: needs 'static' (object) and 'samples' (non-empty list)")
        self.index, self.static = index, spec["static"]
        self.samples: list[dict] = []       # each one complete: the changes applied on top of the one before
        current: dict = {}
        for number, changes in enumerate(spec["samples"]):
            if not isinstance(changes, dict):
                raise ScenarioError(f"{where}.samples[{number}]: expected an object")
            if number == 0 and changes.get("xid_events"):
                raise ScenarioError(f"{where}.samples[0]: xid_events need a sample after the first")
            current = {**{k: v for k, v in current.items() if k != "xid_events"}, **changes}
            self.samples.append(current)

    def sample(self, position: int) -> dict:
        return self.samples[min(position, len(self.samples) - 1)]


class FakeNVML:
    """One fake NVML library: pynvml's API over a scenario, with explicit steps between samples."""

    NVMLError = NVMLError

    def __init__(self, scenario: str | Path | dict, step_seconds: float | None = None):
        self.source, spec = _load(scenario)
        if spec.get("format") != FORMAT:
            raise ScenarioError(f"{self.source}: 'format' must be {FORMAT!r}, got {spec.get('format')!r}")
        self.init_error = (spec.get("init") or {}).get("error")
        self.system = spec.get("system", {})
        self.devices = [_Device(i, d, self.source) for i, d in enumerate(spec.get("devices", []))]
        self.position = 0
        self.initialised = False
        self.generation = 0
        self.init_calls = 0
        self.calls: Counter[str] = Counter()      # how often each function was called, for tests of call cost
        self._event_sets: list[_EventSet] = []
        self._step_seconds = step_seconds
        self._started = time.monotonic()

    # ---------------------------------------------------------------------------------------- stepping

    def advance(self, steps: int = 1) -> None:
        """Move every device to its next sample; XIDs recorded in the samples entered are queued as events."""
        for _ in range(steps):
            self.position += 1
            for device in self.devices:
                if self.position < len(device.samples):
                    for xid in device.samples[self.position].get("xid_events", ()):
                        self._deliver(device.index, xid)

    def _deliver(self, index: int, xid: int) -> None:
        for event_set in self._event_sets:
            if event_set.devices.get(index, 0) & pynvml.nvmlEventTypeXidCriticalError:
                event_set.queue.append(SimpleNamespace(
                    device=FakeHandle(index, self.generation), eventType=pynvml.nvmlEventTypeXidCriticalError,
                    eventData=xid, gpuInstanceId=UINT_MAX, computeInstanceId=UINT_MAX))

    def _sync(self, name: str) -> None:
        self.calls[name] += 1
        if self._step_seconds:
            target = int((time.monotonic() - self._started) / self._step_seconds)
            if target > self.position:
                self.advance(target - self.position)

    # ------------------------------------------------------------------------------- library lifecycle

    def nvmlInit(self) -> None:
        self._sync("nvmlInit")
        self.init_calls += 1
        if self.init_error:
            raise _error(self.init_error)
        self.initialised = True
        self.generation += 1

    def nvmlShutdown(self) -> None:
        self._sync("nvmlShutdown")
        self._require_init()
        self.initialised = False

    def _require_init(self) -> None:
        if not self.initialised:
            raise NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)

    def nvmlSystemGetDriverVersion(self) -> str:
        self._sync("nvmlSystemGetDriverVersion")
        self._require_init()
        return self._lookup_in(self.system, "nvmlSystemGetDriverVersion", "system")

    # ----------------------------------------------------------------------------------------- devices

    def nvmlDeviceGetCount(self) -> int:
        self._sync("nvmlDeviceGetCount")
        self._require_init()
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._sync("nvmlDeviceGetHandleByIndex")
        self._require_init()
        if not 0 <= index < len(self.devices):
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._check_lost(self.devices[index])
        return FakeHandle(index, self.generation)

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> FakeHandle:
        self._sync("nvmlDeviceGetHandleByUUID")
        self._require_init()
        wanted = uuid.decode() if isinstance(uuid, bytes) else uuid
        for device in self.devices:
            if device.static.get("nvmlDeviceGetUUID") == wanted:
                self._check_lost(device)
                return FakeHandle(device.index, self.generation)
        raise NVMLError(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetIndex(self, handle: FakeHandle) -> int:
        self._sync("nvmlDeviceGetIndex")
        self._require_init()
        return handle.index

    def _device(self, handle: Any) -> _Device:
        self._require_init()
        if not isinstance(handle, FakeHandle) or not 0 <= handle.index < len(self.devices):
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if handle.generation != self.generation:     # a handle from before nvmlShutdown
            raise NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        device = self.devices[handle.index]
        self._check_lost(device)
        return device

    def _check_lost(self, device: _Device) -> None:
        if device.sample(self.position).get("lost"):
            raise NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    def _device_call(self, name: str, handle: Any, *args: Any) -> Any:
        self._sync(name)
        device = self._device(handle)
        key = name + (f"({','.join(str(a) for a in args)})" if args else "")
        keys = [key]
        if args:
            keys.append(name + "(" + ",".join(["*", *(str(a) for a in args[1:])]) + ")")
        for candidate in keys:
            for table in (device.sample(self.position), device.static):
                if candidate in table:
                    return _answer(table[candidate])
        raise ScenarioError(f"{self.source}: device {device.index} has no recorded answer for {key}")

    def _lookup_in(self, table: dict, key: str, where: str) -> Any:
        if key not in table:
            raise ScenarioError(f"{self.source}: {where} has no recorded answer for {key}")
        return _answer(table[key])

    def nvmlDeviceGetFieldValues(self, handle: Any, field_ids: list) -> list:
        self._sync("nvmlDeviceGetFieldValues")
        device = self._device(handle)
        recorded = device.sample(self.position).get("nvmlDeviceGetFieldValues", {})
        return [_field_value(recorded, field) for field in field_ids]

    # ------------------------------------------------------------------------------------------ events

    def nvmlEventSetCreate(self) -> _EventSet:
        self._sync("nvmlEventSetCreate")
        self._require_init()
        event_set = _EventSet(self.generation)
        self._event_sets.append(event_set)
        return event_set

    def nvmlDeviceRegisterEvents(self, handle: Any, event_types: int, event_set: _EventSet) -> None:
        self._sync("nvmlDeviceRegisterEvents")
        device = self._device(handle)
        supported = device.static.get("nvmlDeviceRegisterEvents", "supported")
        if isinstance(supported, dict):
            _answer(supported)      # raises the recorded error
        event_set.devices[device.index] = event_set.devices.get(device.index, 0) | event_types

    def nvmlEventSetWait_v2(self, event_set: _EventSet, timeout_ms: int) -> SimpleNamespace:
        self._sync("nvmlEventSetWait_v2")
        self._require_init()
        if event_set.generation != self.generation:
            raise NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        if not event_set.queue:
            raise NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        return event_set.queue.popleft()

    nvmlEventSetWait = nvmlEventSetWait_v2

    # ------------------------------------------------------------------------------------- GPM (Hopper+)
    # A GPM sample remembers the device and the scenario's position when taken; nvmlGpmMetricsGet answers the
    # percentages recorded under "nvmlGpmMetricsGet" ({"<metric id>": value}) of the second sample's position.

    def nvmlGpmSampleAlloc(self) -> SimpleNamespace:
        self._sync("nvmlGpmSampleAlloc")
        self._require_init()
        return SimpleNamespace(device=None, position=None)

    def nvmlGpmSampleGet(self, handle: Any, sample: SimpleNamespace) -> SimpleNamespace:
        self._sync("nvmlGpmSampleGet")
        sample.device, sample.position = self._device(handle), self.position
        return sample

    def nvmlGpmMetricsGet(self, request: "c_nvmlGpmMetricsGet_t") -> "c_nvmlGpmMetricsGet_t":
        self._sync("nvmlGpmMetricsGet")
        self._require_init()
        device = request.sample2.device
        recorded = device.sample(request.sample2.position).get("nvmlGpmMetricsGet", {})
        for metric in request.metrics[:request.numMetrics]:
            value = recorded.get(str(metric.metricId))
            metric.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED if value is None else pynvml.NVML_SUCCESS
            metric.value = float(value or 0.0)
        return request

    def nvmlGpmSampleFree(self, sample: SimpleNamespace) -> None:
        self._sync("nvmlGpmSampleFree")

    def nvmlEventSetFree(self, event_set: _EventSet) -> None:
        self._sync("nvmlEventSetFree")
        if event_set in self._event_sets:
            self._event_sets.remove(event_set)


class c_nvmlGpmMetricsGet_t:
    """pynvml's struct of the same name, as plain attributes (the fake's samples are no C pointers)."""

    def __init__(self) -> None:
        self.version = self.numMetrics = 0
        self.sample1 = self.sample2 = None
        self.metrics = [SimpleNamespace(metricId=0, nvmlReturn=0, value=0.0) for _ in range(pynvml.NVML_GPM_METRIC_MAX)]


FakeNVML.c_nvmlGpmMetricsGet_t = c_nvmlGpmMetricsGet_t


def _make_device_call(name: str):
    def call(self: FakeNVML, handle: Any, *args: Any) -> Any:
        return self._device_call(name, handle, *args)
    call.__name__ = name
    return call


for _name in DEVICE_CALLS:
    setattr(FakeNVML, _name, _make_device_call(_name))
for _name, _value in CONSTANTS.items():
    setattr(FakeNVML, _name, _value)


def _field_value(recorded: dict, field: Any) -> SimpleNamespace:
    field_id, scope_id = field if isinstance(field, tuple) else (field, 0)
    answer = recorded.get(f"{field_id}:{scope_id}")
    entry = SimpleNamespace(fieldId=field_id, scopeId=scope_id, timestamp=0, latencyUsec=0,
                            valueType=pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, nvmlReturn=pynvml.NVML_SUCCESS,
                            value=SimpleNamespace(dVal=0.0, uiVal=0, ulVal=0, ullVal=0, sllVal=0, siVal=0, usVal=0))
    if answer is None:
        entry.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
    elif isinstance(answer, dict):
        entry.nvmlReturn = CONSTANTS[answer["error"]]
    elif isinstance(answer, float):
        entry.valueType, entry.value.dVal = pynvml.NVML_VALUE_TYPE_DOUBLE, answer
    else:
        entry.value.ullVal = entry.value.ulVal = entry.value.uiVal = int(answer)
    return entry


def _load(scenario: str | Path | dict) -> tuple[str, dict]:
    if isinstance(scenario, dict):
        return "<scenario>", scenario
    path = Path(scenario)
    if not path.suffix and not path.exists():
        path = SCENARIOS / f"{scenario}.json"
    try:
        return str(path), json.loads(path.read_text())
    except FileNotFoundError:
        known = ", ".join(sorted(p.stem for p in SCENARIOS.glob("*.json")))
        raise ScenarioError(f"{path}: no such scenario (recorded: {known})") from None
    except json.JSONDecodeError as exc:
        raise ScenarioError(f"{path}:{exc.lineno}: not JSON: {exc.msg}") from None


def energy_scenario(base: str | Path | dict, watts: list[list[float]], seconds_per_sample: float = 1.0) -> dict:
    """A recorded scenario with one sample per entry of `watts` (per device, the power drawn over the
    sample's `seconds_per_sample`): `nvmlDeviceGetPowerUsage` (mW) and the total energy counter
    `nvmlDeviceGetTotalEnergyConsumption` (mJ, from the base scenario's first value) in recorded-values
    style, so energy tests know the counter's every value."""
    _, spec = _load(base)
    devices = []
    for device, draws in zip(spec["devices"], watts):
        counter = int(device["samples"][0]["nvmlDeviceGetTotalEnergyConsumption"])
        samples = []
        for draw in draws:
            samples.append({"nvmlDeviceGetPowerUsage": int(draw * 1000),
                            "nvmlDeviceGetTotalEnergyConsumption": counter})
            counter += int(draw * seconds_per_sample * 1000)
        samples[0] = {**device["samples"][0], **samples[0]}
        devices.append({**device, "samples": samples})
    return {**spec, "origin": f"{spec.get('origin', '')}; energy counter synthesised by energy_scenario",
            "devices": devices}


# ------------------------------------------------------------------- the module itself acting as pynvml

_instance: FakeNVML | None = None


def instance() -> FakeNVML:
    """The process-wide fake behind module-level calls, made from TRAINGUARD_FAKE_NVML on first use."""
    global _instance
    if _instance is None:
        scenario = os.environ.get("TRAINGUARD_FAKE_NVML")
        if not scenario:
            raise ScenarioError("TRAINGUARD_FAKE_NVML is not set: name a scenario under tests/fakes/nvml/")
        step = os.environ.get("TRAINGUARD_FAKE_NVML_STEP_S")
        _instance = FakeNVML(scenario, float(step) if step else None)
    return _instance


def __getattr__(name: str) -> Any:
    if name.startswith("nvml"):
        return getattr(instance(), name)
    raise AttributeError(name)
