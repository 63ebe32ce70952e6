"""The GPU paths of trainguard, proved on one GPU in under five minutes: scripts/gpu-check runs this.

    scripts/gpu-check                          # every check; writes bench/out/gpu_check.json
    scripts/gpu-check --plan                   # say what it would run, run nothing
    scripts/gpu-check --only nvml,training --out /tmp/gpu.json

Nothing but the checkout and its setup (scripts/setup): it uses the checkout's own collector, trainer,
checkpoint manager, fingerprints and benches. On a machine without a GPU (no CUDA device, or no NVML) it
prints what it would run and exits 0, writing nothing. It is never part of CI (a GPU is needed).

The checks, each against its peer on the same GPU and the same run (budget in seconds):

| check | what | peer | pass when |
|---|---|---|---|
| nvml | the gpu collector's readings (real pynvml) | `nvidia-smi --query-gpu` at the same moment | identity equal; memory within 1% + 64 MiB, temperature within 3 C, power within 15%, clocks within 10% |
| xid_ecc | XID counters (every watched code at 0 per GPU, with its class) and the ECC / remapped-rows counters on /metrics | the XID catalogue (trainguard/xid_catalog.py) | every watched code present per GPU; ECC counters present or NVML says NOT_SUPPORTED (ECC off) |
| training | a bf16 run of the bundled trainer (small preset) with telemetry on and off, interleaved (bench/bench_loop.py --device cuda) | the same steps with telemetry off | telemetry under 1% of a step |
| cuda_memory | the trainer's `mem_allocated_bytes` / `mem_reserved_bytes` in its TLS records | torch.cuda.max_memory_allocated / max_memory_reserved over the run | every record > 0, allocated <= reserved <= the device's memory, within torch's peaks |
| mfu | `metrics.mfu` of that run | runtime/mfu.py's peak for this device name, and FLOPs per token x tokens/s recomputed | a peak is found for the device; recomputed MFU equal within 1% |
| energy | NVML's energy counter over the run (what DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION exports) | power sampled at 20 Hz, integrated | within 5% |
| flight_recorder | an NCCL all-reduce enqueued behind a kernel that does not end (torch.cuda._sleep), the Flight Recorder dumped meanwhile (runtime/flight_recorder.py) and read by decide/culprit.enqueued | the collectives issued | the hung collective is in the dump, not completed, and its sequence number is the last enqueued |
| dcp_async | the checkpoint manager's async save: time it blocks the caller | DCP async_save's blocking time, and the device-to-host copy floor (one copy_ of every tensor into pinned host buffers) | <= 1.0x DCP, <= 1.25x the floor |
| fingerprint | the replica check's fingerprint per check (bench/bench_sdc.py --world 1 on NCCL) | Megatron-LM's SHA-1 parameter check on the same weights | >= 20x cheaper |

The JSON it writes is the shape bench/run_all.py reads from bench/out/ ({"name": "gpu_check", "machine",
"figures", "markdown", ...}, plus "checks" with each check's details): `bench/run_all.py --render` then puts
its figures in the summary of docs/benchmarks.md as **GPU** rows and its table as the "GPU check" section.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(ROOT))

from figures import Figure, loop as loop_figures, sdc as sdc_figures  # noqa: E402

FORMAT = "trainguard-gpu-check/1"
TITLE = "GPU check (scripts/gpu-check)"
COMMAND = "scripts/gpu-check"
TOTAL_BUDGET_SECONDS = 290.0


@dataclass
class Check:
    name: str
    what: str
    peer: str
    budget: float                         # seconds expected on one H100/H200 (the subprocesses' timeouts are wider)
    run: Callable[["Context"], "Result"]


@dataclass
class Result:
    status: str = "pass"                  # pass | fail | skip | error
    reason: str = ""
    figures: list[Figure] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Context:
    workdir: Path
    python: str = sys.executable
    shared: dict[str, Any] = field(default_factory=dict)    # what one check leaves for the next (the run)


# ----------------------------------------------------------------------------------------- the checks

SMI_FIELDS = ("index", "uuid", "pci.bus_id", "name", "memory.used", "temperature.gpu", "power.draw", "clocks.sm",
              "clocks.mem")


def check_nvml(ctx: Context) -> Result:
    """The gpu collector against nvidia-smi on the same GPUs, read back to back."""
    from trainguard.agent.collector import Context as CollectorContext
    from trainguard.agent.collectors.gpu import GPUCollector

    collector = GPUCollector(CollectorContext(devfs=Path("/dev"), node="gpu-check", options={"kmsg": False}))
    try:
        sample = collector.update()
        smi = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    finally:
        collector.close()
    ctx.shared["families"] = sample.families
    ours = {str(g["gpu"]): g for g in sample.tls["hardware"]["gpus"]}
    problems, compared = [], 0
    for line in smi.strip().splitlines():
        cells = dict(zip(SMI_FIELDS, (c.strip() for c in line.split(","))))
        gpu = ours.get(cells["index"])
        if gpu is None:
            problems.append(f"GPU {cells['index']}: nvidia-smi lists it, the collector does not")
            continue
        if gpu["uuid"] != cells["uuid"]:
            problems.append(f"GPU {cells['index']}: UUID {gpu['uuid']} vs {cells['uuid']}")
        for ours_key, smi_key, scale, tolerance in (("mem_used_bytes", "memory.used", 2**20, ("abs_rel", 64 * 2**20, 0.01)),
                                                    ("gpu_temp_c", "temperature.gpu", 1, ("abs", 3)),
                                                    ("gpu_power_w", "power.draw", 1, ("rel", 0.15)),
                                                    ("sm_clock_mhz", "clocks.sm", 1, ("rel", 0.10)),
                                                    ("mem_clock_mhz", "clocks.mem", 1, ("rel", 0.10))):
            if ours_key not in gpu or cells.get(smi_key) in (None, "", "[N/A]", "[Not Supported]"):
                continue
            a, b = float(gpu[ours_key]), float(cells[smi_key]) * scale
            kind, *limits = tolerance
            ok = (abs(a - b) <= limits[0] if kind == "abs" else abs(a - b) <= limits[0] * max(abs(b), 1e-9)
                  if kind == "rel" else abs(a - b) <= limits[0] + limits[1] * abs(b))
            compared += 1
            if not ok:
                problems.append(f"GPU {cells['index']} {ours_key}: {a:g} vs nvidia-smi {b:g}")
    details = {"gpus": len(ours), "readings_compared": compared, "problems": problems}
    figure = Figure("NVML collector vs nvidia-smi: readings that agree", f"{compared - len(problems)} of {compared}",
                    "nvidia-smi --query-gpu", f"{compared}", None, "all", not problems and compared > 0)
    return Result("pass" if not problems and compared else "fail", "; ".join(problems[:5]), [figure], details)


def check_xid_ecc(ctx: Context) -> Result:
    from trainguard import xid_catalog

    families = ctx.shared.get("families")
    if families is None:
        return Result("skip", "needs the nvml check's reading")
    samples = [(s.name, s.labels, s.value) for f in families for s in f.samples]
    xids = [(labels["gpu"], labels["xid"], labels["xid_class"]) for name, labels, _ in samples
            if name == "trainguard_gpu_xid_errors_total"]
    gpus = {labels["gpu"] for name, labels, _ in samples if name == "DCGM_FI_DEV_GPU_UTIL"}
    missing = [(gpu, code) for gpu in gpus for code in xid_catalog.WATCHED
               if not any(g == gpu and x == str(code) for g, x, _ in xids)]
    ecc = {name for name, _, _ in samples if name.startswith(("trainguard_gpu_ecc_", "DCGM_FI_DEV_ECC_"))}
    nonzero = [(g, x, c) for g, x, c in xids if c != xid_catalog.class_of(int(x))]
    problems = [f"{len(missing)} watched (GPU, XID) series missing"] if missing else []
    problems += [f"class label wrong: {nonzero[:3]}"] if nonzero else []
    details = {"gpus": sorted(gpus), "xid_series": len(xids), "ecc_families": sorted(ecc),
               "ecc_note": "" if ecc else "no ECC counter: ECC is off on these GPUs (nvidia-smi -q -d ECC)"}
    figure = Figure("XID counters present at 0 from the start (series)", str(len(xids)), "GPUs x watched codes",
                    str(len(gpus) * len(xid_catalog.WATCHED)), None, "all", not missing and not nonzero)
    return Result("fail" if problems else "pass", "; ".join(problems), [figure], details)


def _bench(ctx: Context, script: str, args: list[str], timeout: float) -> str:
    done = subprocess.run([ctx.python, str(BENCH / script), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{script} ended with {done.returncode}: {done.stderr.strip()[-400:]}")
    return done.stdout


def check_training(ctx: Context) -> Result:
    """bench_loop on the GPU: the bundled trainer (bf16 autocast on CUDA), telemetry on and off interleaved."""
    out = _bench(ctx, "bench_loop.py", ["--config", "small", "--steps", "60", "--warmup", "10", "--device", "cuda"],
                 timeout=150)
    figures = loop_figures(out)
    for f in figures:
        f.measure = f"bf16 training on the GPU: {f.measure}"
    return Result("pass" if all(f.met for f in figures) else "fail", "", figures, {"output": out[-2000:]})


def check_cuda_memory_mfu_energy(ctx: Context) -> list[tuple[str, Result]]:
    """One short bf16 run in this process: the trainer's memory and MFU figures against torch's and the
    peak table's, and NVML's energy counter against integrated power samples over the same run."""
    import pynvml
    import torch

    from trainguard import tls
    from trainguard.runtime import mfu as mfu_mod
    from trainguard.trainer.config import TrainConfig, load_file
    from trainguard.trainer.loop import DistInfo, Trainer

    run_dir = ctx.workdir / "run"
    config = load_file(TrainConfig(), "small")
    config.run.device, config.run.telemetry = "cuda", True
    config.run.checkpoint_every = config.run.eval_every = 0
    config.run.log_every = 10**9
    config.run.steps = 40
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    power: list[tuple[float, float]] = []
    stop = threading.Event()

    def sample_power() -> None:
        while not stop.wait(0.05):
            power.append((time.monotonic(), pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0))

    trainer = Trainer(config, run_dir, DistInfo())
    sampler = threading.Thread(target=sample_power, daemon=True)
    energy_before, began = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle), time.monotonic()
    sampler.start()
    try:
        torch.cuda.reset_peak_memory_stats()
        trainer.run()
        torch.cuda.synchronize()
        peak_allocated, peak_reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    finally:
        stop.set()
        sampler.join()
    energy_after, ended = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle), time.monotonic()
    pynvml.nvmlShutdown()
    records = [r for path in sorted((run_dir / "tls").glob("rank-*.jsonl")) for r in tls.read_records(path)]
    steps = [r for r in records if isinstance(r.get("metrics"), dict) and "loss" in r["metrics"]]
    last = steps[-1] if steps else {}
    out = []

    # the TLS carries what the allocator said at each step's end: every value within what torch saw at most
    recorded = [(r["hardware"].get("mem_allocated_bytes"), r["hardware"].get("mem_reserved_bytes"))
                for r in steps if isinstance(r.get("hardware"), dict)]
    recorded = [(a, b) for a, b in recorded if isinstance(a, int) and isinstance(b, int)]
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    ok = bool(recorded) and all(0 < a <= b <= total and a <= peak_allocated and b <= peak_reserved
                                for a, b in recorded)
    top = max((a for a, _ in recorded), default=None)
    out.append(("cuda_memory", Result("pass" if ok else "fail", "" if ok else f"recorded {recorded[-3:]} vs torch's "
                                      f"peaks {(peak_allocated, peak_reserved)}",
                                      [Figure("CUDA memory in the TLS: the largest allocated (bytes)", str(top),
                                              "torch.cuda.max_memory_allocated", str(peak_allocated), None,
                                              "within torch's peaks, > 0", ok)],
                                      {"records": len(recorded), "peak_allocated": peak_allocated,
                                       "peak_reserved": peak_reserved, "total": total})))

    name = torch.cuda.get_device_name()
    found = mfu_mod.lookup(name, "bf16")
    metrics = last.get("metrics") or {}
    if found is None:
        out.append(("mfu", Result("fail", f"no peak in runtime/mfu.py for {name!r}", [], {"device": name})))
    elif "mfu" not in metrics:
        out.append(("mfu", Result("fail", "the run wrote no metrics.mfu", [], {"device": name})))
    else:
        peak = found[1]
        # the model's own FLOPs per token (6N plus attention) times the recorded throughput, over the table's peak
        recomputed = trainer.model.flops_per_token() * metrics["tokens_per_second"] / peak
        close = abs(recomputed - metrics["mfu"]) <= 0.01 * max(recomputed, 1e-12)
        out.append(("mfu", Result("pass" if close else "fail", "", [
            Figure(f"MFU of the small preset, bf16, {found[0].model}", f"{metrics['mfu']:.4f}",
                   f"FLOPs/token x tokens/s over the table's {peak / 1e12:.1f} TFLOP/s", f"{recomputed:.4f}",
                   metrics["mfu"] / recomputed if recomputed else None, "equal within 1%", close)],
            {"device": name, "peak_flops": peak, "source": found[0].source})))

    counted = (energy_after - energy_before) / 1000.0        # mJ -> J
    integrated = sum((t1 - t0) * (p0 + p1) / 2 for (t0, p0), (t1, p1) in zip(power, power[1:]))
    covered = (power[-1][0] - power[0][0]) / max(ended - began, 1e-9) if len(power) > 1 else 0.0
    integrated = integrated / covered if covered else 0.0     # the few ms outside the samples, at their mean
    ratio = counted / integrated if integrated else None
    ok = ratio is not None and abs(ratio - 1) <= 0.05
    out.append(("energy", Result("pass" if ok else "fail", "", [
        Figure("energy over a training run, NVML counter (J)", f"{counted:.1f}", "power sampled at 20 Hz, integrated",
               f"{integrated:.1f}", ratio, "within 5%", ok)],
        {"seconds": round(ended - began, 2), "samples": len(power)})))
    return out


FR_SCRIPT = r"""
import json, os, sys, time
os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from trainguard.runtime import flight_recorder
from trainguard.decide.culprit import enqueued
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
x = torch.ones(1 << 20, device="cuda")
for _ in range(3):
    dist.all_reduce(x)
torch.cuda.synchronize()
torch.cuda._sleep(int(3e9))          # a kernel that keeps the GPU for seconds: the next collective waits
dist.all_reduce(x)                   # enqueued, not completed while the kernel runs
time.sleep(0.5)
trace = json.loads(flight_recorder.dump())
torch.cuda.synchronize()
dist.destroy_process_group()
entries = [e for e in trace.get("entries", []) if not e.get("is_p2p")]
print(json.dumps({"states": [e.get("state") for e in entries], "seqs": [e.get("collective_seq_id") for e in entries],
                  "enqueued": enqueued(trace)}))
"""


def check_flight_recorder(ctx: Context) -> Result:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = ctx.workdir / "fr_hang.py"
    script.write_text(FR_SCRIPT)
    done = subprocess.run([ctx.python, str(script), str(ROOT), str(port)], capture_output=True, text=True, timeout=90)
    if done.returncode != 0:
        return Result("error", f"ended with {done.returncode}: {done.stderr.strip()[-400:]}")
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    states, seqs = seen["states"], seen["seqs"]
    hung = bool(states) and states[-1] != "completed" and all(s == "completed" for s in states[:-1])
    last = max(seen["enqueued"].values(), default=None)
    ok = hung and len(states) == 4 and last == seqs[-1]
    return Result("pass" if ok else "fail", "" if ok else f"states {states}, sequence {seqs}, enqueued {seen['enqueued']}",
                  [Figure("Flight Recorder on NCCL: the hung all-reduce found", f"seq {seqs[-1] if seqs else None} "
                          f"{states[-1] if states else 'none'}", "collectives issued", "4 (the 4th hung)", None,
                          "the 4th, not completed", ok)], seen)


def check_dcp_async(ctx: Context) -> Result:
    import torch

    from bench_checkpoint import _tensors, dcp_async_blocking
    from trainguard.runtime.checkpoint import CheckpointManager
    from trainguard.trainer.config import ModelConfig
    from trainguard.trainer.model import GPT

    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=12, n_head=12, n_embd=768, block_size=256, vocab_size=256)).cuda()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, 256, (4, 256), device="cuda")
    model(idx, idx)[1].backward()
    optim.step()
    state = {"model": model.state_dict(), "optim": optim.state_dict()}
    tensors = [t for t in _tensors(state) if t.is_cuda]
    buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    os.environ["TRAINGUARD_CHECKPOINT_KEY"] = str(ctx.workdir / "key")
    floor, dcp_blocked, ours = [], [], []
    manager = CheckpointManager(ctx.workdir / "async", async_save=True, keep_last=1)
    manager.save(1, state, stable=True)
    manager.wait()
    for i in range(3):
        torch.cuda.synchronize()
        began = time.perf_counter()
        for buffer, tensor in zip(buffers, tensors):
            buffer.copy_(tensor, non_blocking=True)
        torch.cuda.synchronize()
        floor.append(time.perf_counter() - began)
        dcp_blocked.append(dcp_async_blocking(state, ctx.workdir / f"dcp{i}"))
        handle = manager.save(2 + i, state, stable=True)
        manager.wait()
        ours.append(handle.blocking_seconds)
    f, d, o = (statistics.median(v) for v in (floor, dcp_blocked, ours))
    size = sum(t.numel() * t.element_size() for t in tensors)
    figures = [Figure("async save, blocked vs DCP async_save (s), GPT 124M on the GPU", f"{o:.3f}",
                      "DCP async_save", f"{d:.3f}", o / d if d else None, "<= 1.0x", d > 0 and o / d <= 1.0),
               Figure("async save, blocked vs device-to-host copy floor (s)", f"{o:.3f}",
                      "one copy_ into pinned host buffers", f"{f:.3f}", o / f if f else None, "<= 1.25x",
                      f > 0 and o / f <= 1.25)]
    return Result("pass" if all(x.met for x in figures) else "fail", "", figures,
                  {"state_bytes": size, "floor_GBps": round(size / f / 1e9, 1) if f else None})


def check_fingerprint(ctx: Context) -> Result:
    out = _bench(ctx, "bench_sdc.py", ["--configs", "small", "--world", "1", "--rounds", "6", "--warmup", "2"],
                 timeout=150)
    figures = sdc_figures(out)
    for f in figures:
        f.measure = f"on the GPU: {f.measure}"
    return Result("pass" if all(f.met for f in figures) else "fail", "", figures, {"output": out[-2000:]})


CHECKS: tuple[Check, ...] = (
    Check("nvml", "the gpu collector's readings (real pynvml)", "nvidia-smi --query-gpu", 10, check_nvml),
    Check("xid_ecc", "XID counters by code and class at 0, ECC counters", "the XID catalogue", 1, check_xid_ecc),
    Check("training", "bf16 training, telemetry on vs off (bench_loop --device cuda)", "telemetry off", 60,
          check_training),
    Check("run", "a 40-step bf16 run: CUDA memory, MFU, energy", "torch.cuda, the peak table, power samples", 40,
          lambda ctx: Result()),            # stands for cuda_memory, mfu, energy (one run, three results)
    Check("flight_recorder", "an NCCL collective behind a hung kernel, Flight Recorder dumped",
          "the collectives issued", 20, check_flight_recorder),
    Check("dcp_async", "async save blocking, GPT 124M state on the GPU", "DCP async_save; the D2H copy floor", 40,
          check_dcp_async),
    Check("fingerprint", "replica fingerprint per check (bench_sdc --world 1, NCCL)", "Megatron SHA-1 check", 60,
          check_fingerprint),
)


# ----------------------------------------------------------------------------------------- running

def gpu_present() -> tuple[bool, str]:
    """(a CUDA GPU with NVML here, why not)."""
    try:
        import torch
    except ImportError as exc:
        return False, f"torch does not import ({exc})"
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device"
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
    except Exception as exc:       # pynvml raises its own NVMLError subclasses and OSError
        return False, f"NVML does not answer ({exc})"
    if shutil.which("nvidia-smi") is None:
        return False, "nvidia-smi is not on PATH"
    return True, ""


def plan() -> str:
    lines = [f"{COMMAND}: {len(CHECKS)} checks, about {sum(c.budget for c in CHECKS):.0f} s on one GPU "
             f"(checks not started by {TOTAL_BUDGET_SECONDS:.0f} s are skipped)", ""]
    for c in CHECKS:
        lines.append(f"  {c.name:<16} {c.what}  [peer: {c.peer}; about {c.budget:.0f} s]")
    return "\n".join(lines)


def run_checks(only: set[str] | None, workdir: Path) -> list[dict]:
    ctx = Context(workdir)
    results: list[dict] = []
    started = time.monotonic()
    for check in CHECKS:
        if only and check.name not in only and not (check.name == "run" and only & {"cuda_memory", "mfu", "energy"}):
            continue
        if time.monotonic() - started > TOTAL_BUDGET_SECONDS:
            results.append({"name": check.name, "status": "skip", "reason": "the 5-minute budget is spent",
                            "seconds": 0.0, "figures": [], "details": {}})
            continue
        began = time.monotonic()
        print(f"== {check.name}: {check.what}", flush=True)
        try:
            produced = (check_cuda_memory_mfu_energy(ctx) if check.name == "run"
                        else [(check.name, check.run(ctx))])
        except Exception as exc:     # one check's failure is its result; the others still run
            produced = [(check.name, Result("error", f"{type(exc).__name__}: {exc}"))]
        seconds = round(time.monotonic() - began, 1)
        for name, result in produced:
            results.append({"name": name, "status": result.status, "reason": result.reason, "seconds": seconds,
                            "figures": [asdict(f) for f in result.figures], "details": _plain(result.details)})
            print(f"   {name}: {result.status}" + (f" ({result.reason})" if result.reason else ""), flush=True)
    return results


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def markdown(checks: list[dict]) -> str:
    """The section run_all renders: one row per check, its figures beside their peers."""
    lines = ["## " + TITLE, "", "| check | status | figure | ours | peer | peer value | ours / peer | target | s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in checks:
        figures = c["figures"] or [{"measure": c["reason"] or "", "ours": "", "peer_name": "", "peer": "",
                                    "ratio": None, "target": ""}]
        for f in figures:
            ratio = "" if f["ratio"] is None else f"{f['ratio']:.3g}"
            lines.append(f"| {c['name']} | {c['status']} | {f['measure']} | {f['ours']} | {f['peer_name']} "
                         f"| {f['peer']} | {ratio} | {f['target']} | {c['seconds']} |")
    failed = [c for c in checks if c["status"] not in ("pass",)]
    if failed:
        lines += ["", "Not passed: " + "; ".join(f"{c['name']}: {c['status']}"
                                                 + (f" ({c['reason']})" if c["reason"] else "") for c in failed)]
    return "\n".join(lines) + "\n"


def result_document(checks: list[dict], started_at: str, seconds: float, machine: dict) -> dict:
    """The bench/out/gpu_check.json bench/run_all.py renders (its result shape, plus the checks)."""
    return {"format": FORMAT, "name": "gpu_check", "title": TITLE, "script": "bench/gpu_check.py",
            "command": COMMAND, "quick": False, "started_at": started_at, "seconds": round(seconds, 1),
            "returncode": 0, "stdout": "", "stderr_tail": "", "machine": machine,
            "figures": [f for c in checks for f in c["figures"]], "extract_error": None,
            "markdown": markdown(checks), "checks": checks}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", action="store_true", help="say what would run, run nothing")
    parser.add_argument("--only", help="comma-separated checks (nvml, xid_ecc, training, cuda_memory, mfu, energy, "
                                       "flight_recorder, dcp_async, fingerprint)")
    parser.add_argument("--out", type=Path, default=BENCH / "out" / "gpu_check.json")
    args = parser.parse_args(argv)
    if args.plan:
        print(plan())
        return 0
    present, why = gpu_present()
    if not present:
        print(f"{COMMAND}: no GPU here ({why}); this is what it runs on one:\n\n{plan()}\n\nnothing run, "
              "nothing written.")
        return 0
    from run_all import machine

    began, started_at = time.monotonic(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        checks = run_checks(set(args.only.split(",")) if args.only else None, Path(tmp))
    document = result_document(checks, started_at, time.monotonic() - began, machine())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=1) + "\n")
    passed = sum(c["status"] == "pass" for c in checks)
    print(f"{passed} of {len(checks)} checks passed in {document['seconds']:.0f} s; wrote {args.out}; "
          f"render with: .venv/bin/python bench/run_all.py --render")
    with contextlib.suppress(OSError):
        sys.stdout.flush()
    return 0 if passed == len(checks) else 1


if __name__ == "__main__":
    sys.exit(main())
