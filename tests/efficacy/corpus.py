"""The labelled corpus that scores how right trainguard is: generated shapes of healthy
training and of faults, many seeds and sizes, plus the real logs of ../shared/real-logs with labels read
from their numbers (SOURCES.md).

Each `Case` says which actions and alerts are right (`expect`, in `trainguard replay --expect`'s own
vocabulary: `{action, step, time, count}` / `{alertname, labels, time}`), which are tolerated (neither
right nor wrong: a skip on the spike's own steps after a rollback, a stop after a divergence that keeps
coming back), and so which are wrong: everything else. `onset` is the step the trouble starts at, from
which the delay to the first right action is counted.

Imported by bench/bench_efficacy.py (the score) and tests/efficacy/ (each shape of §2 as a test); the
product never imports it. Pure generation: `Case.write(folder)` is the only I/O.
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

from trainguard import tls

T0 = 1_710_512_538.0            # 2024-03-15T14:22:18Z
GPUS = 8
NODE = "gpu-node-1"


def _real_logs() -> Path:
    """$TRAINGUARD_REAL_LOGS, else the nearest `shared/real-logs` beside an ancestor of this checkout."""
    if os.environ.get("TRAINGUARD_REAL_LOGS"):
        return Path(os.environ["TRAINGUARD_REAL_LOGS"])
    for folder in Path(__file__).resolve().parents:
        if (folder / "shared" / "real-logs").is_dir():
            return folder / "shared" / "real-logs"
    return Path(__file__).resolve().parents[3] / "shared" / "real-logs"


REAL_LOGS = _real_logs()
# Actions that must never happen on a healthy run (a skip is a cost, these lose work or end the run).
HARMFUL = ("rollback", "restore", "stop", "cost_warn", "cost_throttle", "cost_stop")
# Alerts that page a human or act (severity critical, or an action label).
PAGING = ("LossNaN", "LossSpike", "GradNormExplosion", "TrainingStalled")
# What a recorded fault goes on to cause after the right action: the log was recorded without it, so the
# bad steps after a rollback are seen again (skips, more rollbacks, the limit's stop). Neither right nor wrong.
CONSEQUENCES = ("skip_step", "rollback", "stop", "LossNaN", "LossSpike", "GradNormExplosion")


@dataclass
class Case:
    name: str
    shape: str                          # the generator (or "real:<folder>") it comes from
    healthy: bool
    expect: dict                        # replay --expect's vocabulary: actions, alerts
    files: dict[str, list[dict]] = field(default_factory=dict)     # file name -> TLS records
    path: Path | None = None            # a real log (read as it is) instead of `files`
    tolerate: tuple[str, ...] = ()      # action or alert names neither right nor wrong here
    onset: int | None = None            # the first step of the trouble
    why: str = ""                       # where the labels come from (for a real log: SOURCES.md's numbers)
    hold: float = 0.0                   # replay.hold: seconds the exporters keep the last values (a hang)

    def write(self, folder: Path) -> Path:
        """The case's input for `trainguard replay`: its real log, or its files written under `folder`."""
        if self.path is not None:
            return self.path
        target = folder / self.name
        target.mkdir(parents=True, exist_ok=True)
        for name, records in self.files.items():
            with open(target / name, "w") as out:
                for record in records:
                    out.write(json.dumps(record) + "\n")
        return target


# ------------------------------------------------------------------------------------------ shapes

def _record(step: int, when: float, loss: float, grad: float, *, step_time: float, rank: int = 0,
            gpus: int = GPUS, **hardware: Any) -> dict:
    record = {"schema": tls.SCHEMA_ID, "timestamp": tls.format_timestamp(when), "run_id": "efficacy",
              "node": NODE, "rank": rank, "step": step,
              "metrics": {"loss": loss, "grad_norm": grad, "learning_rate": 3e-4,
                          "step_time_seconds": step_time, "tokens_per_second": 4096 / step_time},
              "system": {"gpu_count": gpus, "world_size": gpus}}
    if hardware:
        record["hardware"] = hardware
    return record


@dataclass
class Run:
    """A healthy pretraining run's numbers: a loss falling from `start` towards `floor`, relative per-step
    noise `noise` (Gaussian, or Student-t with `tail` degrees of freedom), a gradient norm near `grad`
    with its own noise, one step every `step_time` seconds."""

    rng: random.Random
    start: float = 10.8
    floor: float = 2.4
    tau: float = 400.0
    noise: float = 0.015
    tail: float = 0.0               # 0: Gaussian; else Student-t with this many degrees of freedom
    grad: float = 1.0
    grad_noise: float = 0.08
    step_time: float = 1.0

    def draw(self) -> float:
        if not self.tail:
            return self.rng.gauss(0, 1)
        # Student-t: a Gaussian over the root of a chi-square / dof, scaled to unit variance where finite.
        chi = sum(self.rng.gauss(0, 1) ** 2 for _ in range(int(self.tail))) / self.tail
        scale = math.sqrt((self.tail - 2) / self.tail) if self.tail > 2 else 0.5
        return self.rng.gauss(0, 1) / math.sqrt(chi) * scale

    def loss(self, step: int) -> float:
        return (self.floor + (self.start - self.floor) * math.exp(-step / self.tau)) * (1 + self.noise * self.draw())

    def grad_norm(self, step: int) -> float:
        return self.grad * math.exp(self.grad_noise * self.draw())

    def records(self, steps: range, *, t0: float = T0, loss: Callable[[int, float], float] | None = None,
                grad: Callable[[int, float], float] | None = None, pace: Callable[[int], float] | None = None,
                **hardware: Any) -> list[dict]:
        out, when = [], t0
        for step in steps:
            seconds = pace(step) if pace else self.step_time * (1 + 0.02 * self.rng.random())
            when += seconds
            value, norm = self.loss(step), self.grad_norm(step)
            out.append(_record(step, when, loss(step, value) if loss else value, grad(step, norm) if grad else norm,
                               step_time=seconds, **hardware))
        return out


def healthy(seed: int, steps: int) -> Case:
    rng = random.Random(seed)
    run = Run(rng, noise=rng.uniform(0.008, 0.03), grad_noise=rng.uniform(0.05, 0.15))
    return Case(f"healthy-s{seed}-n{steps}", "healthy", True, {"none": True},
                {"rank-0.jsonl": run.records(range(1, steps + 1))})


def heavy_tailed(seed: int, steps: int) -> Case:
    """Healthy, but each step's loss and gradient norm drawn from a Student-t with 3 degrees of freedom."""
    rng = random.Random(seed)
    run = Run(rng, noise=0.02, tail=3, grad_noise=0.1, tau=2000.0)
    return Case(f"heavy-tailed-s{seed}-n{steps}", "heavy_tailed", True, {"none": True},
                {"rank-0.jsonl": run.records(range(1, steps + 1))}, tolerate=("skip_step",))


def loss_scaler_overflow(seed: int, steps: int) -> Case:
    """fp16/bf16: an isolated step now and then (and a pair once) with an infinite or NaN gradient norm,
    the loss normal. Skipping is tolerated; a rollback, a stop or a paging alert is wrong."""
    rng = random.Random(seed)
    run = Run(rng)
    overflows = set()
    step = 150
    while step < steps:
        overflows.add(step)
        step += rng.randint(120, 600)
    pair = sorted(overflows)[len(overflows) // 2]
    overflows.add(pair + 1)
    records = run.records(range(1, steps + 1),
                          grad=lambda s, g: (math.inf if rng.random() < 0.5 else math.nan) if s in overflows else g)
    return Case(f"overflow-s{seed}-n{steps}", "loss_scaler_overflow", True, {"none": True},
                {"rank-0.jsonl": records}, tolerate=("skip_step",))


def data_mix_change(seed: int, steps: int, *, anneal: bool = False) -> Case:
    """A planned change of the data mix (or an annealing phase's new data): at `at` the loss steps up by
    10-40% and stays, the gradients normal. Skips while the guard tells a new level from a spike are
    tolerated; a rollback or stop is wrong."""
    rng = random.Random(seed)
    run = Run(rng, tau=300.0)
    at = steps // 2 + rng.randint(-100, 100)
    jump = rng.uniform(0.10, 0.40) if not anneal else rng.uniform(0.05, 0.15)

    def loss(step: int, value: float) -> float:
        if step < at:
            return value
        scaled = value * (1 + jump)
        return scaled * (1 - 0.1 * (1 - math.exp(-(step - at) / 500))) if anneal else scaled

    kind = "anneal" if anneal else "data-mix"
    return Case(f"{kind}-s{seed}-n{steps}", "anneal" if anneal else "data_mix_change", True, {"none": True},
                {"rank-0.jsonl": run.records(range(1, steps + 1), loss=loss)}, tolerate=("skip_step",), onset=at)


def restarted(seed: int, steps: int) -> Case:
    """A run that crashed at `crash`, was restarted 10-40 minutes later from its checkpoint at `resume`
    and appended to the same log: the step goes back, a gap in time. A restart, not a spike, not a hang."""
    rng = random.Random(seed)
    run = Run(rng)
    crash = steps // 2 + rng.randint(0, 300)
    resume = crash - crash % 500 if crash % 500 else crash - 500
    first = run.records(range(1, crash + 1))
    gap = rng.uniform(600, 2400)
    t_restart = tls.parse_timestamp(first[-1]["timestamp"]) + gap
    second = run.records(range(resume + 1, steps + 1), t0=t_restart)
    return Case(f"restart-s{seed}-n{steps}", "restart", True, {"none": True}, {"rank-0.jsonl": first + second},
                onset=crash)


def warmup_healthy(seed: int, steps: int) -> Case:
    """The first steps of a healthy run: the loss wobbles up by up to 40% before it falls (no spike)."""
    rng = random.Random(seed)
    run = Run(rng, tau=60.0)
    bump = rng.uniform(1.1, 1.4)
    records = run.records(range(1, steps + 1), loss=lambda s, v: v * (bump if 2 <= s <= 4 else 1.0),
                          grad=lambda s, g: g * (30 if s <= 10 else 1))
    return Case(f"warmup-healthy-s{seed}-n{steps}", "warmup_healthy", True, {"none": True},
                {"rank-0.jsonl": records})


def _clustered(rng: random.Random, steps: int, keep: float, sigma: float) -> list[float]:
    """An AR(1) series: each value `keep` times the one before plus Gaussian noise, `sigma` its spread."""
    out, value, noise = [], 0.0, sigma * math.sqrt(1 - keep * keep)
    for _ in range(steps):
        value = keep * value + rng.gauss(0, noise)
        out.append(value)
    return out


def soak_healthy(seed: int, steps: int) -> Case:
    """The soak's fault-free reference (bench/bench_soak.py: `trainguard train`, the tiny byte-level model
    reading the standard library's source in order, 4 ranks): a loss that falls fast, then wanders by about
    10% over hundreds of steps (easier and harder files) and by 8% in clusters of a few steps, with 5% noise
    per step; every 1500-3000 steps a hard stretch of 8-14 steps at 1.4-1.85 times the loss, the gradient
    norm unmoved; and a gradient norm that climbs from 0.85 towards 2.35 over the run (as the soak's did,
    at a constant learning rate) with 20% noise in clusters of a step or two and a 3.5% slow wander. Its
    statistics are those of the soak's logs (docs/benchmarks.md, "LossDrift and hard batches on healthy
    runs"): the old drift rule rolled back both, and the old spike rule skipped the hard stretches."""
    rng = random.Random(seed)
    slow, fast, white = (_clustered(rng, steps, keep, sigma) for keep, sigma in ((0.995, 0.10), (0.8, 0.08),
                                                                                   (0.0, 0.05)))
    hard: dict[int, float] = {}
    at = rng.randint(1500, 3000)
    while at < steps - 20:
        hard.update((step, rng.uniform(1.4, 1.85)) for step in range(at, at + rng.randint(8, 14)))
        at += rng.randint(1500, 3000)
    wander, clusters = _clustered(rng, steps, 0.99, 0.035), _clustered(rng, steps, 0.45, 0.2)
    records, when = [], T0
    for i in range(steps):
        step = i + 1
        when += 0.2
        base = 1.45 + 1.5 * math.exp(-i / 350) - 0.1 * i / steps
        loss = base * math.exp(slow[i] + fast[i] + white[i]) * hard.get(step, 1.0)
        grad = (0.85 + 1.5 * (1 - math.exp(-i / 3000))) * math.exp(wander[i] + clusters[i])
        records.append(_record(step, when, loss, grad, step_time=0.2))
    return Case(f"soak-healthy-s{seed}-n{steps}", "soak_healthy", True, {"none": True}, {"rank-0.jsonl": records},
                onset=min(hard) if hard else None)


# -------------------------------------------------------------------------------------------- faults

def spike(seed: int, steps: int) -> Case:
    """A loss spike of 1-3 steps (loss x3-x50, gradient norm x20-x100): skips; 3 in a row roll back."""
    rng = random.Random(seed)
    run = Run(rng)
    at, length = rng.randint(steps // 3, 2 * steps // 3), rng.randint(1, 3)
    factor, grad_factor = rng.uniform(3, 50), rng.uniform(20, 100)
    bad = range(at, at + length)
    records = run.records(range(1, steps + 1), loss=lambda s, v: v * factor if s in bad else v,
                          grad=lambda s, g: g * grad_factor if s in bad else g)
    actions = [{"action": "skip_step", "step": [at, at + length - 1]}]
    if length >= 3:
        actions.append({"action": "rollback", "step": [at + 2, at + 2]})
    return Case(f"spike-s{seed}-n{steps}-x{length}", "spike", False, {"actions": actions},
                {"rank-0.jsonl": records}, onset=at, tolerate=CONSEQUENCES)


def warmup_spike(seed: int, steps: int) -> Case:
    """A real spike in the first steps (as the BLOOM-era Megatron-DeepSpeed log at iteration 3: x3.6)."""
    rng = random.Random(seed)
    run = Run(rng, tau=80.0)
    at = rng.randint(3, 12)
    records = run.records(range(1, steps + 1), loss=lambda s, v: v * rng.uniform(3, 4) if s == at else v,
                          grad=lambda s, g: g * 60 if s == at else g)
    return Case(f"warmup-spike-s{seed}-n{steps}", "warmup_spike", False,
                {"actions": [{"action": "skip_step", "step": [at, at]}]}, {"rank-0.jsonl": records}, onset=at)


def nan_burst(seed: int, steps: int) -> Case:
    """NaN loss and gradient norm for 3-20 steps in a row: skips, then a rollback at the third."""
    rng = random.Random(seed)
    run = Run(rng)
    at, length = rng.randint(steps // 3, 2 * steps // 3), rng.randint(3, 20)
    bad = range(at, at + length)
    records = run.records(range(1, steps + 1), loss=lambda s, v: math.nan if s in bad else v,
                          grad=lambda s, g: math.nan if s in bad else g)
    return Case(f"nan-burst-s{seed}-n{steps}-x{length}", "nan_burst", False,
                {"actions": [{"action": "skip_step", "step": [at, at + 1]}, {"action": "rollback", "step": [at + 2, at + 2]}]},
                {"rank-0.jsonl": records}, tolerate=CONSEQUENCES, onset=at)


def explosion(seed: int, steps: int) -> Case:
    """The gradient norm x30-x300 for 1-4 steps, the loss barely moved: skips; 3 or more roll back."""
    rng = random.Random(seed)
    run = Run(rng)
    at, length = rng.randint(steps // 3, 2 * steps // 3), rng.randint(1, 4)
    factor = rng.uniform(30, 300)
    bad = range(at, at + length)
    records = run.records(range(1, steps + 1), grad=lambda s, g: g * factor if s in bad else g)
    actions = [{"action": "skip_step", "step": [at, at + length - 1]}]
    if length >= 3:
        actions.append({"action": "rollback", "step": [at + 2, at + 2]})
    return Case(f"explosion-s{seed}-n{steps}-x{length}", "explosion", False, {"actions": actions},
                {"rank-0.jsonl": records}, onset=at, tolerate=CONSEQUENCES)


def slow_divergence(seed: int, steps: int) -> Case:
    """From `at` (past the loss's fast fall) the loss climbs by 30-60% over 300-800 steps, the gradient
    norm rising with it by 1.5-3x: no step leaves any band. Right: a rollback before the loss's trend is
    20% above its floor of the 512 steps before (the latest right step is computed from the noise-free
    trend); later rollbacks and a stop, as the recorded climb goes on, are tolerated."""
    rng = random.Random(seed)
    run = Run(rng, tau=150.0, noise=rng.uniform(0.008, 0.02))
    at, span = rng.randint(max(1000, steps // 3), max(1000, steps // 2)), rng.randint(300, 800)
    climb, grad_climb = rng.uniform(0.3, 0.6), rng.uniform(1.5, 3.0)
    steps = max(steps, at + span + 200)

    def ramp(step: int) -> float:
        return min(max(step - at, 0) / span, 1.0)

    def trend(step: int) -> float:
        return (run.floor + (run.start - run.floor) * math.exp(-step / run.tau)) * (1 + climb * ramp(step))

    trends = [trend(step) for step in range(steps + 1)]
    late = next(step for step in range(at, steps + 1) if trends[step] >= 1.2 * min(trends[max(0, step - 512):step + 1]))
    records = run.records(range(1, steps + 1), loss=lambda s, v: v * (1 + climb * ramp(s)),
                          grad=lambda s, g: g * (1 + (grad_climb - 1) * ramp(s)))
    return Case(f"slow-divergence-s{seed}-n{steps}", "slow_divergence", False,
                {"actions": [{"action": "rollback", "step": [at, late]}]}, {"rank-0.jsonl": records},
                tolerate=("rollback", "stop", "skip_step"), onset=at)


def hang(seed: int, steps: int) -> Case:
    """Rank 0 stops stepping at `at` while the node keeps reporting: the stall watchdog restores."""
    rng = random.Random(seed)
    run = Run(rng)
    at = rng.randint(steps // 3, 2 * steps // 3)
    ranks = run.records(range(1, at + 1))
    last = tls.parse_timestamp(ranks[-1]["timestamp"])
    node = [{"schema": tls.SCHEMA_ID, "timestamp": tls.format_timestamp(when), "node": NODE,
             "hardware": {"gpus": [{"gpu": i, "gpu_util": 0.0, "gpu_temp_c": 60.0} for i in range(GPUS)]},
             "system": {"gpu_count": GPUS}}
            for when in (T0 + 5 * k for k in range(int((last + 300 - T0) / 5)))]
    return Case(f"hang-s{seed}-n{steps}", "hang", False,
                {"actions": [{"action": "restore", "time": [last - T0 + 55, last - T0 + 200]}],
                 "alerts": [{"alertname": "TrainingStalled", "time": [last - T0 + 55, last - T0 + 240]}]},
                {"rank-0.jsonl": ranks, f"node-{NODE}.jsonl": node}, onset=at, hold=150.0)


def straggler(seed: int, steps: int) -> Case:
    """Two ranks on two nodes; from `at` rank 1 takes 2-3x as long a step: an alert, no action on the run."""
    rng = random.Random(seed)
    run = Run(rng, step_time=2.0)
    at = rng.randint(steps // 4, steps // 2)
    slow = rng.uniform(2.0, 3.0)
    files = {}
    for rank in (0, 1):
        records = run.records(range(1, steps + 1))
        for record in records:
            record["rank"], record["node"] = rank, f"gpu-node-{rank + 1}"
            if rank == 1 and record["step"] >= at:
                record["metrics"]["step_time_seconds"] *= slow
        files[f"rank-{rank}.jsonl"] = records
    return Case(f"straggler-s{seed}-n{steps}", "straggler", False,
                {"alerts": [{"alertname": "TrainingStraggler"}]}, files, onset=at)


def cost_overrun(seed: int, steps: int, tier: str) -> Case:
    """8 GPUs at $2/h: 100 steps at 25 s ($111 per 1000 steps, under the default $120), then steps slow
    enough to overrun the budget into `tier` (warn +30%, throttle +60%, stop +100%)."""
    rng = random.Random(seed)
    run = Run(rng)
    slow = {"warn": rng.uniform(36.0, 40.0), "throttle": rng.uniform(45.0, 49.0), "stop": rng.uniform(57.0, 62.0)}[tier]
    records = run.records(range(1, steps + 1), pace=lambda s: 25.0 if s <= 100 else slow)
    tiers = {"warn": ["cost_warn"], "throttle": ["cost_warn", "cost_throttle"],
             "stop": ["cost_warn", "cost_throttle", "cost_stop"]}[tier]
    return Case(f"cost-{tier}-s{seed}-n{steps}", f"cost_{tier}", False,
                {"actions": [{"action": name, "count": 1} for name in tiers],
                 "alerts": [{"alertname": "CostBudget" + name.split("_")[1].capitalize()} for name in tiers]},
                {"rank-0.jsonl": records}, onset=101)


def overheating(seed: int, steps: int) -> Case:
    """A node log, 8 GPUs every 5 s, one GPU at 88-95 C for six minutes: an alert for that GPU, no action."""
    rng = random.Random(seed)
    hot, start, length = rng.randrange(GPUS), rng.randint(60, 120), 72
    node = []
    for k in range(steps):
        gpus = [{"gpu": i, "gpu_util": 97.0, "gpu_temp_c": round((rng.uniform(88, 95) if i == hot and start <= k < start + length
                                                                 else rng.gauss(70, 1)), 1)} for i in range(GPUS)]
        node.append({"schema": tls.SCHEMA_ID, "timestamp": tls.format_timestamp(T0 + 5 * k), "node": NODE,
                     "hardware": {"gpus": gpus}, "system": {"gpu_count": GPUS}})
    return Case(f"overheating-s{seed}-n{steps}", "overheating", False,
                {"alerts": [{"alertname": "GPUOverheating", "labels": {"gpu": str(hot)}}]},
                {f"node-{NODE}.jsonl": node}, onset=start)


# ---------------------------------------------------------------------------------------- the corpus

def loss_only(case: Case) -> Case:
    """The same case as a log that prints no gradient norm (Megatron-DeepSpeed's MoE and random_ltd logs,
    DeepSpeed's `grad norm: 0.000` placeholder, a loss-scale search): the guard decides on the loss alone.
    A fault whose only sign is the gradient norm has nothing to see here, so only loss faults are made so."""
    files = {name: [{**record, "metrics": {key: value for key, value in record["metrics"].items() if key != "grad_norm"}}
                    for record in records] for name, records in case.files.items()}
    return replace(case, name=case.name + "-loss-only", shape=case.shape + "_loss_only", files=files)


def generated(scale: float = 1.0) -> Iterator[Case]:
    """Every generated shape over several seeds and sizes; `scale` < 1 shortens the long ones (tests)."""
    def n(steps: int) -> int:
        return max(400, int(steps * scale))

    for seed in range(3):
        for steps in (600, 3000):
            yield healthy(seed, n(steps))
            yield loss_scaler_overflow(seed, n(steps))
            yield data_mix_change(seed, n(steps))
            yield data_mix_change(seed, n(steps), anneal=True)
            yield restarted(seed, n(steps))
            yield spike(seed, n(steps))
            yield nan_burst(seed, n(steps))
            yield explosion(seed, n(steps))
            yield slow_divergence(seed, n(steps) + 1000)
        yield heavy_tailed(seed, n(30_000))
        yield soak_healthy(seed, n(9_000))
        yield warmup_healthy(seed, 400)
        yield warmup_spike(seed, 400)
        yield hang(seed, 600)
        yield straggler(seed, 600)
        for tier in ("warn", "throttle", "stop"):
            yield cost_overrun(seed, 300, tier)
        yield overheating(seed, 300)
    for seed in range(3):       # logs with a loss and no gradient norm
        yield loss_only(healthy(seed, n(3000)))
        yield loss_only(data_mix_change(seed, n(3000)))
        yield loss_only(spike(seed, n(3000)))
        yield loss_only(nan_burst(seed, n(3000)))
        yield loss_only(warmup_healthy(seed, 400))
        yield loss_only(warmup_spike(seed, 400))
    yield loss_only(heavy_tailed(0, n(30_000)))
    for seed in range(3, 6):
        yield spike(seed, n(5000))
        yield slow_divergence(seed, n(5000))
        yield loss_scaler_overflow(seed, n(10_000))
        yield data_mix_change(seed, n(10_000))


# ------------------------------------------------------------------------------------------ real logs

# (path under real-logs, healthy, expect, tolerate, why): the labels come from the numbers SOURCES.md
# gives (and the files show), never from a replay.
REAL: tuple[tuple[str, bool, dict, tuple[str, ...], str], ...] = (
    ("megatron/bigscience_meg_ds_3d_gpt2_perf_n16-ds-off.out", False,
     {"actions": [{"action": "skip_step", "step": [3, 3]}]}, ("skip_step", "rollback", "stop"),
     "loss 12.445 -> 44.243 at iteration 3 (x3.6), then diverges back to 20.44 by 62"),
    ("megatron/bigscience_meg_ds_3d_gpt2_perf_n16-ds-on.out", False,
     {"actions": [{"action": "skip_step", "step": [3, 3]}]}, ("skip_step", "rollback", "stop"),
     "lm-loss 12.445 -> 41.03 at iteration 3"),
    ("megatron/bigscience_meg_gpt2_base_n8_dp1_tp4_pp8-1809562.out", False,
     {"actions": [{"action": "skip_step", "step": [30, 30]}]}, ("skip_step", "rollback", "stop"),
     "loss 12.106 -> 26.48 at iteration 30 (x2.2), grad norm 67 then 81, recovery to 7.53"),
    ("megatron/bigscience_meg_gpt2_base_n16_dp1_tp4_pp16-1809577.out", False,
     {"actions": [{"action": "skip_step", "step": [30, 30]}]}, ("skip_step", "rollback", "stop"),
     "loss 12.49 -> 32.83 at iteration 30"),
    ("megatron/msft_megatron-deepspeed_MoE_gpt3-0.125B-with-kernel.log", True, {"none": True}, (),
     "healthy: 213 iterations, loss 10.69 -> 4.57"),
    ("megatron/msft_megatron-deepspeed_random_ltd_gpt3-0.125B-baseline.log", True, {"none": True}, (),
     "healthy: 47 iterations, loss 10.78 -> 8.10"),
    ("megatron/bigscience_tr8-104B_excerpt_L638-643_iter11446-11448.log", False,
     {"actions": [{"action": "skip_step", "step": [11448, 11448]}]}, ("skip_step", "rollback"),
     "loss 3.06 -> 7.71 at 11448 (x2.5), grad norm 12,952 -> 262,623 (x20)"),
    ("megatron/bigscience_tr8-104B_excerpt_L923-934_iter8738-8743.log", False,
     {"actions": [{"action": "skip_step", "step": [8741, 8741]}]}, ("skip_step", "rollback"),
     "loss 3.32 -> 7.27 at 8741 (x2.2 over the first, x1.97 over the highest before it), grad norm x14"),
    ("megatron/bigscience_tr8-104B_excerpt_L940-943_iter9026-9027.log", False,
     {"actions": [{"action": "skip_step", "step": [9027, 9027]}]}, ("skip_step", "rollback"),
     "iteration 9027 has no lm loss (not finite) and the loss scale halved: the start of the divergence"),
    ("megatron/bigscience_tr11-176B-BLOOM_chronicles_L202-213_first_lm_loss_spike_iter31214-31251.log", False,
     {"actions": [{"action": "skip_step", "step": [31219, 31219]}]}, ("skip_step", "rollback"),
     "loss 2.20 -> 5.10 at 31219 (x2.3), grad norm 0.24 -> 960 (x4000)"),
    ("megatron/bigscience_tr8b-104B_chronicles_L446-460_overflow_spike_iter17060-17068.log", False,
     {"actions": [{"action": "skip_step", "step": [17062, 17062]}]}, ("skip_step", "rollback"),
     "loss 2.67 -> 4.37 at 17062 (x1.6), overflow lines between"),
    ("hf/Dheena731_tinyLlama-finetune_trainer_state.json", True, {"none": True}, (), "healthy SFT, loss 2.08 -> 1.01"),
    ("hf/Jaong_Checkpoint-of-CPT_trainer_state.json", True, {"none": True}, (), "healthy, logging_steps 500"),
    ("hf/aigoncharov_trainer_state_viz_trainer_state.json", True, {"none": True}, (), "healthy, six eval sets"),
    ("hf/10844110_t5-summarization-demo_trainer_state.json", False,
     {"actions": [{"action": "skip_step", "step": [190000, 190000]}]}, ("skip_step",),
     "grad norm 2.40 -> 35.59 at 190000 (14.7x the median), back at 190500"),
    ("hf/syGOAT_Mistral-v0.2-Translator-bf16_trainer_state.json", True, {"none": True}, (),
     "healthy LoRA fine-tune, grad norm 8.13 at 3220 (5x the median: under the 10x factor)"),
    ("torchtitan/auroraGPT-ANL_torchtitan_blendcorpus_aurora_md_L121-623.log", True, {"none": True}, ("skip_step",),
     "loss 10.86 -> 15.20 in steps 2-3 (x1.4, grad norm 42 -> 67) then down to 5.3: a warm-up wobble"),
)


def real(root: Path = REAL_LOGS) -> Iterator[Case]:
    """The real logs that are present (none when the folder is absent: the caller says so)."""
    for relative, is_healthy, expected, tolerate, why in REAL:
        path = root / relative
        if path.exists():
            yield Case("real:" + Path(relative).name, "real:" + relative.split("/")[0], is_healthy, expected,
                       path=path, tolerate=tolerate, why=why)
