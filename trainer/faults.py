"""Fault injection for tests, the demo and drills: ``--inject KIND@STEP[:RANK]``, repeatable.

| kind                 | at STEP, on RANK (default)                                                      |
|----------------------|---------------------------------------------------------------------------------|
| `nan`                | the loss (and so every gradient) becomes NaN (all ranks)                         |
| `spike`              | the loss is multiplied by SPIKE_FACTOR before backward (all ranks)               |
| `gradexplode`        | gradients are scaled by GRAD_FACTOR; the loss is left alone (all ranks)          |
| `hang`               | the rank sleeps forever, as a deadlocked collective would look (rank 0)          |
| `crash`              | the rank kills itself with SIGKILL, no clean-up (rank 0)                         |
| `error`              | the rank raises an exception in its step, as a bug or a CUDA error would (rank 0) |
| `slowio`             | the data loader sleeps SLOWIO_SECONDS per batch for SLOWIO_STEPS steps (all)      |
| `corrupt-checkpoint` | one byte is flipped in the first checkpoint saved at or after STEP (rank 0)      |
| `commhang`           | every rank blocks in a receive nobody sends: all wait in the same collective op,  |
|                      | as a network or job-wide fault looks (no culprit rank) (all ranks)               |
| `slowrank`           | the rank's compute is slowed SLOWRANK_FACTOR x for SLOWRANK_STEPS steps (rank 0) |
| `bitflip`            | one bit of one weight flips before the step's forward (rank 0)                   |
| `gradflip`           | one bit of one gradient flips after the all-reduce, before the update (rank 0)   |

bitflip and gradflip pick parameter number STEP mod (number of parameters), its element of largest
magnitude (never a zero, whose flipped bit an update could wash out), and the mantissa bit two below
the top (float32: bit 21; bfloat16: 5; float16: 8): a change of an eighth to a quarter of the value,
silent (no NaN, no spike), as silent data corruption is. The replica check (trainer/replica_check.py)
is what catches them.

``KIND@tUNIXTIME[:RANK]`` fires at the first step that begins at or after that wall-clock time (seconds since
the epoch) instead of at a step number: a soak (bench/bench_soak.py) puts its faults minutes apart in wall
time, the same for a run that recovers in a second and one that restarts for a minute.

A fault fires once per run, across restarts and rollbacks: it is recorded in
``RUN/control/faults-fired.jsonl`` (fsynced, before a crash or hang happens), which every rank reads at
start, so ``crash@50`` does not crash the resumed run again. Each firing is a ``fault_injected`` event.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from trainguard import event_types, rundir, safe_read

KINDS = ("nan", "spike", "gradexplode", "hang", "crash", "slowio", "corrupt-checkpoint",
         "slowrank", "bitflip", "gradflip", "commhang", "error")
# Faults of one rank by default; the others hit every rank. A flip on every replica alike would be no
# corruption, and a slow rank is slow against the others.
DEFAULT_RANK = {"hang": 0, "crash": 0, "error": 0, "corrupt-checkpoint": 0, "slowrank": 0, "bitflip": 0, "gradflip": 0}

SPIKE_FACTOR = 100.0
GRAD_FACTOR = 1e4
SLOWIO_SECONDS = 0.5
SLOWIO_STEPS = 5
# slowrank: a fail-slow rank (a throttled GPU, a noisy neighbour). Its compute takes this many times its
# usual step, for this many steps; at least SLOWRANK_MIN_SECONDS more per step, so a tiny CPU step slows too.
SLOWRANK_FACTOR = 4.0
SLOWRANK_STEPS = 40
SLOWRANK_MIN_SECONDS = 0.05


class FaultError(ValueError):
    pass


class InjectedError(RuntimeError):
    """The `error` fault: an exception in one rank's step (recovered in-process, docs/recovery.md)."""


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None    # None: every rank
    at_time: float | None = None    # the wall-clock form: the first step at or after this time (step is 0)

    @property
    def key(self) -> str:
        when = f"t{self.at_time!r}" if self.at_time is not None else str(self.step)
        return f"{self.kind}@{when}" + ("" if self.rank is None else f":{self.rank}")

    def due(self, step: int, at_or_after: bool = False) -> bool:
        if self.at_time is not None:
            return time.time() >= self.at_time
        return self.step == step or at_or_after and step >= self.step

    def applies_to(self, rank: int) -> bool:
        return self.rank is None or self.rank == rank


def parse(spec: str) -> Fault:
    """``KIND@STEP`` or ``KIND@STEP:RANK`` (RANK an integer or ``all``); ``KIND@tUNIXTIME[:RANK]`` for a
    wall-clock time instead of a step."""
    kind, sep, rest = spec.partition("@")
    step_text, _, rank_text = rest.partition(":")
    if not sep or kind not in KINDS:
        raise FaultError(f"--inject {spec!r}: expected KIND@STEP[:RANK] with KIND one of {', '.join(KINDS)}")
    at_time = None
    try:
        if step_text.startswith("t"):
            step, at_time = 0, float(step_text[1:])
        else:
            step = int(step_text)
        rank = None if rank_text == "all" else int(rank_text) if rank_text else DEFAULT_RANK.get(kind)
    except ValueError:
        raise FaultError(f"--inject {spec!r}: STEP (or tUNIXTIME) and RANK must be numbers") from None
    if (step < 1 and at_time is None) or (at_time is not None and not at_time > 0) or (rank is not None and rank < 0):
        raise FaultError(f"--inject {spec!r}: STEP must be >= 1, tUNIXTIME > 0 and RANK >= 0")
    return Fault(kind, step, rank, at_time)


class FaultInjector:
    """The faults of this run that apply to this rank and have not fired yet."""

    def __init__(self, specs: list[str], run_dir: str | os.PathLike, rank: int,
                 emit: Callable[..., object]):
        self.rank, self.emit = rank, emit
        self.fired_path = rundir.faults_fired_path(run_dir)
        fired = self._read_fired()
        self.pending = [f for f in map(parse, specs) if f.applies_to(rank) and f.key not in fired]
        self.slow_until = 0
        self.slowrank = SlowRank()

    def _read_fired(self) -> set[str]:
        try:
            lines = safe_read.read_text(self.fired_path, safe_read.LEDGER_BYTES, "control log").splitlines()
        except FileNotFoundError:
            return set()
        return {json.loads(line)["fault"] for line in lines if line.strip()}

    def _take(self, kind: str, step: int, at_or_after: bool = False) -> Fault | None:
        for fault in self.pending:
            if fault.kind == kind and fault.due(step, at_or_after):
                self.pending.remove(fault)
                return fault
        return None

    def _fire(self, fault: Fault, step: int, **detail: object) -> None:
        """Record the firing durably first: the fault may end this process a moment later."""
        self.fired_path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"fault": fault.key, "step": step, "rank": self.rank, "time": time.time()})
        fd = safe_read.open_rw_fd(self.fired_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "control log")
        try:
            os.write(fd, (line + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        self.emit(event_types.FAULT_INJECTED, step=step, kind=fault.kind, fault=fault.key, **detail)

    # ---------------------------------------------------------------------------------- the hooks
    def loss_factors(self, step: int) -> tuple[float, float]:
        """(factor on the reported loss, extra factor on the gradients) for this step's backward."""
        loss_factor = grad_factor = 1.0
        self._slow_compute(step)    # called after the batch is loaded: the delay is compute, not data wait
        if fault := self._take("nan", step):
            self._fire(fault, step)
            loss_factor = float("nan")
        if fault := self._take("spike", step):
            self._fire(fault, step, factor=SPIKE_FACTOR)
            loss_factor *= SPIKE_FACTOR
        if fault := self._take("gradexplode", step):
            self._fire(fault, step, factor=GRAD_FACTOR)
            grad_factor = GRAD_FACTOR
        return loss_factor, grad_factor

    def _slow_compute(self, step: int) -> None:
        if fault := self._take("slowrank", step):
            delay = self.slowrank.start(step)
            self._fire(fault, step, factor=SLOWRANK_FACTOR, steps=SLOWRANK_STEPS, seconds=round(delay, 6))
        time.sleep(self.slowrank.delay(step))

    def data_delay(self, step: int) -> float:
        """Seconds the data loader should stall before this step's batch (slowio)."""
        if fault := self._take("slowio", step):
            self._fire(fault, step, seconds=SLOWIO_SECONDS, steps=SLOWIO_STEPS)
            self.slow_until = step + SLOWIO_STEPS
        return SLOWIO_SECONDS if step < self.slow_until else 0.0

    def process_faults(self, step: int) -> None:
        """hang, crash and error: this process stops making progress, dies without cleaning up, or raises."""
        if fault := self._take("crash", step):
            self._fire(fault, step)
            os.kill(os.getpid(), signal.SIGKILL)
        if fault := self._take("error", step):
            self._fire(fault, step)
            raise InjectedError(f"injected fault {fault.key}: an exception in rank {self.rank}'s step {step}")
        if fault := self._take("hang", step):
            self._fire(fault, step)
            while True:
                time.sleep(3600)
        if fault := self._take("commhang", step):
            self._fire(fault, step)
            _wait_for_nobody()

    def after_checkpoint(self, step: int, directory: Path, wait: Callable[[], None]) -> None:
        """corrupt-checkpoint: flip one byte in the middle of the largest file of a fresh checkpoint
        (after `wait` has made it durable, so an async save is corrupted on disk, not in flight)."""
        if not (fault := self._take("corrupt-checkpoint", step, at_or_after=True)):
            return
        wait()
        victim = max((p for p in directory.iterdir() if p.is_file() and p.name != rundir.CHECKPOINT_MANIFEST),
                     key=lambda p: p.stat().st_size)
        offset = victim.stat().st_size // 2
        with open(victim, "r+b") as handle:
            handle.seek(offset)
            byte = handle.read(1)
            handle.seek(offset)
            handle.write(bytes([byte[0] ^ 0xFF]))
        self._fire(fault, step, file=str(victim), offset=offset)

    # ----------------------------------------------------------------------- silent corruption
    def bit_flip(self, step: int, params: list, names: list[str]) -> None:
        """bitflip: one bit of one weight, before this step's forward."""
        if fault := self._take("bitflip", step):
            self._fire(fault, step, **_flip_one(params, names, step, grads=False))

    def grad_flip(self, step: int, params: list, names: list[str]) -> None:
        """gradflip: one bit of one gradient, after the all-reduce and before the optimizer reads it."""
        if fault := self._take("gradflip", step):
            self._fire(fault, step, **_flip_one(params, names, step, grads=True))


MANTISSA_BITS = {"float64": 52, "float32": 23, "bfloat16": 7, "float16": 10}


def _flip_one(params: list, names: list[str], step: int, grads: bool) -> dict:
    import torch

    from trainguard.trainer.fingerprint import flip_bit

    index = step % len(params)
    tensor = params[index].grad if grads else params[index].data
    if tensor is None:
        tensor = params[index].grad = torch.zeros_like(params[index])
    element = int(tensor.detach().abs().reshape(-1).argmax())
    bit = MANTISSA_BITS.get(str(tensor.dtype).removeprefix("torch."), 3) - 2
    before = float(tensor.reshape(-1)[element])
    flip_bit(tensor, element, bit)
    return {"param": names[index], "element": element, "bit": bit, "before": before,
            "after": float(tensor.reshape(-1)[element]), "target": "gradient" if grads else "weight"}


class SlowRank:
    """The slowrank fault's clock: this rank's usual step period (measured between steps before the
    fault), and the extra seconds each slowed step sleeps."""

    def __init__(self) -> None:
        self.periods: list[float] = []
        self.last: float | None = None
        self.until = 0
        self.extra = 0.0

    def start(self, step: int) -> float:
        usual = sorted(self.periods)[len(self.periods) // 2] if self.periods else 0.0
        self.extra = max(SLOWRANK_MIN_SECONDS, (SLOWRANK_FACTOR - 1.0) * usual)
        self.until = step + SLOWRANK_STEPS
        return self.extra

    def delay(self, step: int) -> float:
        now = time.monotonic()
        if self.last is not None and step >= self.until:
            self.periods = (self.periods + [now - self.last])[-16:]   # usual periods only, not slowed ones
        self.last = now
        return self.extra if step < self.until else 0.0


def _wait_for_nobody() -> None:
    """Block in a torch.distributed receive from the next rank, which is receiving too (never returns)."""
    import torch
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() < 2:
        while True:
            time.sleep(3600)
    dist.recv(torch.zeros(1), src=(dist.get_rank() + 1) % dist.get_world_size())
