"""Soak: the stack running for N minutes with faults injected at random; every fault handled, the agent's
memory flat, nothing lost. A bench, not part of CI.

    .venv/bin/python bench/soak.py                    # 10 minutes, seed 0
    .venv/bin/python bench/soak.py --minutes 2 --seed 7 --no-servers

What runs (tests/e2e/stack.py, all on loopback): one `trainguard agent` with its embedded path on,
Prometheus with the generated rules and Alertmanager routing to the agent (unless --no-servers or not
installed), and the bundled trainer with 2 ranks under torch's elastic launcher. The run is trained in
episodes of EPISODE_STEPS steps on one run directory; each episode gets 1 to 3 faults drawn at random
(nan, spike, gradexplode, slowio, corrupt-checkpoint, and at most one hang or crash, placed last), and
once in the soak the agent itself is killed with SIGKILL and started again on the same address.

At the end it checks, from the run's own records:
- every fault that fired was handled: nan/spike/gradexplode -> the guard's skip_step at that step;
  hang -> the agent's restore and a resumed run_start; crash -> the launcher's restart, resumed from a
  checkpoint; slowio -> the slow steps are recorded (data wait); corrupt-checkpoint -> never restored from;
- every episode reached its last step (nothing lost beyond the steps redone from the last checkpoint);
- the agent's view equals the trainer's logs: trainguard_training_steps_total per rank is the number of
  step records each rank wrote (the agent killed once in between);
- the agent's memory is flat: its RSS, sampled every 2 s after a warm-up, grows less than 10% (or 16 MiB).

It prints a summary and writes bench/out/soak.json, which bench/run_all.py renders into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from run_all import OUT, machine  # noqa: E402  (bench/ is on the path: this is a script beside it)
from tests.e2e.stack import read_records, stack  # noqa: E402
from tests.servers import http_get, start, wait_for  # noqa: E402

EPISODE_STEPS = 150
GUARD_WARMUP = 80           # steps the guard needs after a (re)start before it judges spikes and explosions
POLICY = {
    # Short stall so a hang is restored within seconds; no rate limit on restores: the soak hangs often.
    "alerts": {"stall_seconds": 8.0, "for_short": "2s", "for_long": "5s", "action_cooldown_seconds": 20.0,
               "max_restores_per_hour": 1000},
    "guard": {"spike_min_steps": 50, "grad_min_steps": 50, "max_rollbacks_per_hour": 1000},
}
GUARD_FAULTS = ("nan", "spike", "gradexplode")
OTHER_FAULTS = ("slowio", "corrupt-checkpoint")
PROCESS_FAULTS = ("hang", "crash")
RSS_WARMUP_SECONDS = 30
EPISODE_TIMEOUT = 600.0
FLAT_RATIO, FLAT_BYTES = 0.10, 16 * 2**20


# ------------------------------------------------------------------------------------------- driving

def draw_faults(rng: random.Random, first: int, last: int) -> list[str]:
    """1 to 3 faults at distinct steps in [first + GUARD_WARMUP, last - 10]; a hang or crash comes last."""
    low, high = first + GUARD_WARMUP, last - 10
    kinds = rng.sample(GUARD_FAULTS + OTHER_FAULTS, rng.randint(0, 2))
    if rng.random() < 0.6:
        kinds.append(rng.choice(PROCESS_FAULTS))
    kinds = kinds or [rng.choice(GUARD_FAULTS)]
    steps = sorted(rng.sample(range(low, high), len(kinds)))
    return [f"{kind}@{step}" for kind, step in zip(kinds, steps)]


class RSSSampler(threading.Thread):
    """VmRSS of the agent's current process every `interval` seconds, as (time, pid, bytes)."""

    def __init__(self, pid_of, interval: float = 2.0):
        super().__init__(daemon=True)
        self.pid_of, self.interval = pid_of, interval
        self.samples: list[tuple[float, int, int]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.interval):
            pid = self.pid_of()
            try:
                text = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            rss = next((int(line.split()[1]) * 1024 for line in text.splitlines() if line.startswith("VmRSS:")), 0)
            self.samples.append((time.monotonic(), pid, rss))


def restart_agent(s) -> None:
    """SIGKILL the agent and start it again with the same command, on the same address."""
    agent = s.agents[0]
    command = list(agent.server.process.args)
    os.kill(agent.server.process.pid, signal.SIGKILL)
    agent.server.process.wait()
    agent.server = start(command, url=f"http://{agent.address}", ready_url=f"http://{agent.address}/healthz",
                         log_path=agent.log_path, env={**os.environ, "TRAINGUARD_LOG_JSON": "1"})


def end_tree(process) -> None:
    """SIGKILL a trainer and every process under it (the launcher's workers are not all in its group)."""
    import psutil

    try:
        tree = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for child in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def last_step(run_dir: Path) -> int:
    steps = [r["step"] for r in read_records(run_dir / "tls" / "rank-0.jsonl") if r.get("metrics")]
    return max(steps, default=0)


# ------------------------------------------------------------------------------------------- checking

def step_records(run_dir: Path, rank: int) -> list[dict]:
    return [r for r in read_records(run_dir / "tls" / f"rank-{rank}.jsonl")
            if r.get("metrics") and r.get("step") is not None and not r.get("event")]


def agent_steps(address: str) -> dict[str, float] | None:
    status, _, body = http_get(f"http://{address}/metrics", timeout=10)
    if status != 200:
        return None
    return {sample.labels["rank"]: sample.value for family in text_string_to_metric_families(body.decode())
            for sample in family.samples if sample.name == "trainguard_training_steps_total"}


def handled(fault: dict, events: list[dict], agent_events: list[dict], run_dir: Path) -> tuple[bool, str]:
    """Whether one fired fault was handled, and how (from the run's records)."""
    kind, step, when = fault["event"]["kind"], fault["step"], fault["timestamp"]
    later = [r for r in events if r["timestamp"] >= when]
    if kind in GUARD_FAULTS:
        skips = [r for r in later if r["event"]["type"] in ("skip_step", "rollback") and r.get("step") == step]
        return bool(skips), f"guard {skips[0]['event']['type']} ({skips[0]['event'].get('reason')})" if skips \
            else "no skip_step at that step"
    if kind in PROCESS_FAULTS:
        resumed = [r for r in later if r["event"]["type"] == "run_start" and r["event"].get("resumed_from") is not None]
        restores = [e for e in agent_events if e["event"]["type"] == "action" and e["event"].get("action") == "restore"
                    and e["timestamp"] >= when]
        if kind == "hang" and not restores:
            return False, "no restore by the agent"
        if not resumed:
            return False, "no resumed run_start"
        how = "agent restore, " if kind == "hang" else ""
        return True, f"{how}resumed from step {resumed[0]['event']['resumed_from']}"
    if kind == "slowio":
        slow = [r for r in step_records(run_dir, 0) if step <= r["step"] < step + 5
                and (r["metrics"].get("data_wait_seconds") or 0) >= 0.4]
        return bool(slow), "slow steps recorded (data wait)" if slow else "no slow step recorded"
    if kind == "corrupt-checkpoint":
        damaged = str(Path(fault["event"]["file"]).parent)
        restored = [r for r in later if r["event"]["type"] == "checkpoint_restored" and r["event"].get("path") == damaged]
        return not restored, "never restored from" if not restored else "RESTORED from a corrupted checkpoint"
    return False, f"unknown fault kind {kind}"


def memory_verdict(samples: list[tuple[float, int, int]]) -> dict:
    """Growth of the agent's RSS over its longest life, after a warm-up: first third against last third."""
    by_pid: dict[int, list[tuple[float, int]]] = {}
    for when, pid, rss in samples:
        by_pid.setdefault(pid, []).append((when, rss))
    life = max(by_pid.values(), key=lambda s: s[-1][0] - s[0][0], default=[])
    life = [rss for when, rss in life if when - life[0][0] >= RSS_WARMUP_SECONDS]
    if len(life) < 6:
        return {"flat": None, "samples": len(life), "why": "too few samples after the warm-up"}
    third = len(life) // 3
    start, end = statistics.median(life[:third]), statistics.median(life[-third:])
    growth = end - start
    return {"flat": growth < max(FLAT_RATIO * start, FLAT_BYTES), "start_bytes": start, "end_bytes": end,
            "growth_bytes": growth, "peak_bytes": max(life), "samples": len(life)}


# ---------------------------------------------------------------------------------------------- main

def soak(minutes: float, seed: int, servers: bool, keep: Path | None) -> dict:
    rng = random.Random(seed)
    tmp = Path(tempfile.mkdtemp(prefix="trainguard-soak-", dir=keep))
    episodes, began = [], time.monotonic()
    deadline = began + minutes * 60
    with stack(tmp, POLICY) as s:
        s.start_agent("n1", embedded=True)
        if servers:
            s.start_servers()
        sampler = RSSSampler(lambda: s.agents[0].server.process.pid)
        sampler.start()
        agent_kill_at = began + minutes * 60 * rng.uniform(0.2, 0.4)
        agent_killed = False
        while time.monotonic() < deadline:
            first = last_step(s.run_dir)
            target = first + EPISODE_STEPS
            faults = draw_faults(rng, first, target)
            n = len(episodes)
            print(f"episode {n}: steps {first} -> {target}, faults {' '.join(faults)}", flush=True)
            trainer = s.train("--steps", str(target), "--nproc", "2", "--max-restarts", "5",
                              "--checkpoint-every", "20", *(f"--inject={f}" for f in faults), name=f"episode-{n}")
            stuck_at = time.monotonic() + EPISODE_TIMEOUT
            while trainer.poll() is None and time.monotonic() < stuck_at:
                if not agent_killed and time.monotonic() >= agent_kill_at:
                    print("  killing the agent (SIGKILL) and starting it again", flush=True)
                    restart_agent(s)
                    agent_killed = True
                time.sleep(0.5)
            if trainer.poll() is None:
                print(f"  episode {n} stuck for {EPISODE_TIMEOUT:.0f} s: ended", flush=True)
                end_tree(trainer)
            episodes.append({"faults": faults, "first": first, "target": target, "returncode": trainer.returncode,
                             "reached": last_step(s.run_dir)})
        sampler.done.set()
        counts = {str(r): len(step_records(s.run_dir, r)) for r in (0, 1)}
        try:
            seen = wait_for(lambda: (agent_steps(s.agents[0].address) == counts) and counts, 120,
                            message="the agent catching up with the trainer's logs")
        except TimeoutError:
            seen = agent_steps(s.agents[0].address)
        events = [r for r in read_records(s.run_dir / "tls" / "rank-0.jsonl") if r.get("event")]
        agent_events = s.agent_events("n1")
        fired = [r for r in events if r["event"]["type"] == "fault_injected"]
        verdicts = [{"fault": f["event"]["fault"], "step": f["step"], **dict(zip(("handled", "how"),
                     handled(f, events, agent_events, s.run_dir)))} for f in fired]
    result = {"minutes": minutes, "seed": seed, "servers": servers, "episodes": episodes, "faults": verdicts,
              "agent_killed": agent_killed, "agent_view": seen, "trainer_logs": counts,
              "memory": memory_verdict(sampler.samples), "rss_samples": len(sampler.samples),
              "seconds": round(time.monotonic() - began, 1)}
    if keep is None:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        result["run_dir"] = str(tmp)
    return result


def verdict(result: dict) -> dict[str, bool]:
    return {"every fault handled": bool(result["faults"]) and all(f["handled"] for f in result["faults"]),
            "every episode reached its last step": all(e["returncode"] == 0 and e["reached"] == e["target"]
                                                       for e in result["episodes"]),
            "agent's view equals the trainer's logs": result["agent_view"] == result["trainer_logs"],
            "agent memory flat": result["memory"].get("flat") is True}


def summary(result: dict, checks: dict[str, bool]) -> str:
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    m = result["memory"]
    lines = [f"soak: {result['seconds'] / 60:.1f} min, seed {result['seed']}, "
             f"{'with' if result['servers'] else 'without'} Prometheus and Alertmanager, "
             f"{len(result['episodes'])} episodes, {len(result['faults'])} faults fired, agent killed once: "
             f"{'yes' if result['agent_killed'] else 'no'}", "",
             "| fault | step | handled | how |", "|---|---:|---|---|"]
    lines += [f"| {f['fault']} | {f['step']} | {'yes' if f['handled'] else '**NO**'} | {f['how']} |"
              for f in result["faults"]]
    lines += ["", f"- steps per rank, trainer's logs {result['trainer_logs']}, agent's view {result['agent_view']}"]
    if m.get("flat") is not None:
        lines.append(f"- agent RSS after {RSS_WARMUP_SECONDS} s warm-up: {mib(m['start_bytes'])} -> {mib(m['end_bytes'])} "
                     f"(growth {mib(m['growth_bytes'])}, peak {mib(m['peak_bytes'])}, {m['samples']} samples)")
    else:
        lines.append(f"- agent RSS: {m.get('why')}")
    lines += [f"- {name}: {'yes' if ok else '**NO**'}" for name, ok in checks.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-servers", action="store_true", help="without Prometheus and Alertmanager")
    parser.add_argument("--keep", type=Path, help="keep the run directory under this folder")
    parser.add_argument("--out", type=Path, default=OUT / "soak.json")
    args = parser.parse_args(argv)
    servers = not args.no_servers and all(shutil.which(b) for b in ("prometheus", "prometheus-alertmanager"))
    started_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    host = machine()
    result = soak(args.minutes, args.seed, servers, args.keep)
    checks = verdict(result)
    text = summary(result, checks)
    print(text)
    command = ".venv/bin/python bench/soak.py" + "".join(
        f" {flag}" for flag in (f"--minutes {args.minutes:g}" if args.minutes != 10 else "",
                                f"--seed {args.seed}" if args.seed else "",
                                "--no-servers" if args.no_servers else "") if flag)
    m = result["memory"]
    figures = [{"measure": "faults handled", "ours": f"{sum(f['handled'] for f in result['faults'])} of "
                f"{len(result['faults'])}", "peer_name": "", "peer": "", "ratio": None, "target": "all",
                "met": checks["every fault handled"]},
               {"measure": "agent RSS growth over the soak", "ours": f"{m.get('growth_bytes', 0) / 2**20:.1f} MiB",
                "peer_name": "its RSS after warm-up", "peer": f"{m.get('start_bytes', 0) / 2**20:.1f} MiB",
                "ratio": (m["end_bytes"] / m["start_bytes"]) if m.get("start_bytes") else None,
                "target": "< 10 % or 16 MiB", "met": checks["agent memory flat"]},
               {"measure": "steps in the agent's view vs the trainer's logs", "ours": json.dumps(result["agent_view"]),
                "peer_name": "trainer's logs", "peer": json.dumps(result["trainer_logs"]), "ratio": None,
                "target": "equal", "met": checks["agent's view equals the trainer's logs"]}]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "name": "soak", "title": "Soak", "script": "bench/soak.py", "command": command, "quick": False,
        "started_at": started_at, "seconds": result["seconds"], "returncode": 0 if all(checks.values()) else 1,
        "stdout": text, "markdown": "## Soak\n" + text, "stderr_tail": "", "machine": host, "figures": figures,
        "extract_error": None, "result": result}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
