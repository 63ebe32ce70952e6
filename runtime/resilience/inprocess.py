"""In-process restart: the process group re-formed in the same interpreters after a rank's failure.

    groups = ProcessGroups.from_env("gloo", rank, world, timeout=..., barrier_seconds=60, log=log)
    groups.form()                  # generation 0: the job's group, on the job's store
    groups.watch()                 # a thread: another rank's failure aborts this rank's group
    ...
    except Exception as exc:       # in the training loop, on every rank that sees a failure
        timings = groups.recover(exc)   # abort, meet, re-form; RecoveryFailed when the barrier is not met

The job's store is torchrun's c10d TCPStore (``env://``: MASTER_ADDR, MASTER_PORT; rank 0 hosts it,
or the elastic agent does when it shares its own). It outlives every process group, so it is where the
ranks meet when their group is broken. Generation g's group lives under the prefix ``trainguard/pg/<g>``
of that store, so a re-formed group never reads the keys of the one before.

A failure, on the rank it happens to (an exception in its step, a collective's error or timeout):

1. ``trainguard/recovery/<g>/fault``: the first rank to get there writes its rank and cause (compare-and-set:
   the first word stands; a rank whose error was only a peer's abort does not overwrite it);
2. it aborts every process group it holds (NCCL: ``ncclCommAbort``; gloo: its connections are shut down,
   sockets.py, as gloo's own abort wakes no operation in flight), so a peer blocked in a collective with
   it gets an error at once instead of waiting for the timeout;
3. every other rank's watcher thread sees the fault key within `WATCH_SECONDS` and aborts its own groups
   the same way, which also releases its own main thread from a collective it is blocked in; a main thread
   that has not begun the recovery a second after the abort (stuck outside any collective) is interrupted
   (request.py's `MainThreadInterrupt`). The watcher also reads the agent's signed requests (request.py):
   a request taken is written as the generation's fault, and goes the same way;
4. every rank adds itself to ``trainguard/recovery/<g>/arrived`` and waits until all `world_size` have;
   one that does not arrive within `barrier_seconds` (a dead or hung process) fails the recovery:
   RecoveryFailed, the surviving ranks exit, and the launcher restarts every worker as it always did;
5. generation g+1's group is formed with the same ranks, and the caller restores the state
   (runtime/resilience/restore.py).

What a re-formed group invalidates is the caller's to rebuild: DDP's reducer holds the old group (the
trainer wraps the model again), and so does any `new_group`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta
from typing import Any

from trainguard import actions
from trainguard.runtime.resilience import request as requests_mod
from trainguard.runtime.resilience import sockets

PG_PREFIX = "trainguard/pg"
RECOVERY_PREFIX = "trainguard/recovery"
WATCH_SECONDS = 0.1      # how often a rank asks the store whether another rank failed


class RecoveryFailed(RuntimeError):
    """The ranks could not re-form in-process: the failure goes the launcher's way (restart every worker)."""


class ProcessGroups:
    def __init__(self, store: Any, backend: str, rank: int, world_size: int, *, timeout: timedelta,
                 barrier_seconds: float, log: Any):
        self.store, self.backend = store, backend
        self.rank, self.world = rank, world_size
        self.timeout, self.barrier_seconds = timeout, barrier_seconds
        self.log = log
        self.generation = 0
        self._lock = threading.Lock()
        self._aborted = -1                 # the newest generation this rank aborted
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None
        self._connections: set[int] = set()   # socket inodes of the current group's gloo connections
        self.replacing = False             # a standby in a dead rank's place: `join`, not `form` (standby.py)
        # The agent's signed requests (request.py), a second source of faults; set by the component once
        # the run's key is known. And the main thread's interrupt, for a rank stuck outside a collective.
        self.requests: requests_mod.RequestWatch | None = None
        self.interrupt: requests_mod.MainThreadInterrupt | None = None
        self._entered = -1                 # the newest generation whose recovery this rank's main thread began
        self._recovering = False           # from an abort to the end of the re-forming
        self._aborted_at: float | None = None
        self._nudged_at = 0.0

    @classmethod
    def from_env(cls, backend: str, rank: int, world_size: int, **kwargs: Any) -> "ProcessGroups":
        """On the job's store as ``init_process_group(init_method="env://")`` would open it."""
        import torch.distributed as dist

        store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=kwargs["timeout"]))
        return cls(store, backend, rank, world_size, **kwargs)

    # --------------------------------------------------------------------------------------- forming
    def form(self) -> None:
        """This generation's process group, as the default group."""
        import torch.distributed as dist

        if self.backend == "nccl":
            # CleanUpOnly: NCCL's watchdog aborts the communicators of a failed or timed-out collective and
            # the error surfaces in this process, instead of the watchdog ending it (1, the default).
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        prefix = dist.PrefixStore(f"{PG_PREFIX}/{self.generation}", self.store)
        before = set(sockets.inodes())
        dist.init_process_group(self.backend, store=prefix, rank=self.rank, world_size=self.world,
                                timeout=self.timeout)
        # gloo connects its full mesh while the group forms: these are the connections an abort shuts down
        self._connections = set(sockets.inodes()) - before

    def watch(self) -> None:
        """Start the thread that aborts this rank's groups when another rank reports a failure."""
        self.interrupt = requests_mod.MainThreadInterrupt.install()
        self._watcher = threading.Thread(target=self._watch, name="trainguard-recovery-watch", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        warned = False
        while not self._closed.wait(WATCH_SECONDS):
            generation = self.generation
            try:
                failed = self.store.check([self._key(generation, "fault")])
            except Exception as exc:   # the store's host is gone: the launcher restarts the job
                if not warned:
                    self.log.warning("the job's store cannot be reached; an in-process restart is not possible",
                                     error=str(exc))
                    warned = True
                continue
            if failed or self._requested(generation):
                self.abort(generation)
                self._nudge(generation)

    def _requested(self, generation: int) -> bool:
        """An agent's signed request taken now: written as the generation's fault, as a failing rank would."""
        if self.requests is None or self._recovering:
            return False        # none, or a recovery is under way: it serves the request
        taken = self.requests.poll()
        if taken is None:
            return False
        cause = json.dumps({"rank": taken.get("culprit_rank"), "request": taken["id"],
                            "cause": f"the agent's request {taken['id']}: {taken.get('reason') or actions.RESTORE}"})
        try:
            self.store.compare_set(self._key(generation, "fault"), "", cause)
        except Exception as exc:    # the abort still releases this rank; the barrier decides the rest
            self.log.warning("cannot write the request's fault in the job's store", error=str(exc))
        return True

    def _nudge(self, generation: int) -> None:
        """A main thread that has not begun the recovery `INTERRUPT_SECONDS` after the abort is stuck
        outside any collective (an abort releases those): interrupt it, again every `INTERRUPT_SECONDS`,
        until it begins or the barrier's bound has passed."""
        now = time.monotonic()
        if self.interrupt is None or self._entered >= generation or self._aborted_at is None:
            return
        waited = now - self._aborted_at
        if waited < requests_mod.INTERRUPT_SECONDS or waited > self.barrier_seconds \
                or now - self._nudged_at < requests_mod.INTERRUPT_SECONDS:
            return
        self._nudged_at = now
        self.log.warning("the main thread has not begun the recovery: interrupting it", generation=generation,
                         waited_seconds=round(waited, 3))
        self.interrupt.interrupt()

    def abort(self, generation: int) -> bool:
        """Abort every process group of `generation` (once); whether this call did it."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        with self._lock:
            if self._aborted >= generation or generation != self.generation:
                return False
            self._aborted = generation
            self._aborted_at = time.monotonic()
            self._recovering = True
            if self.requests is not None:
                self.requests.settled()    # a request issued before this abort is served by its recovery
            if dist.is_initialized():
                try:
                    c10d._abort_process_group()     # the default group and every group made from it
                except (RuntimeError, ValueError) as exc:   # already destroyed under us
                    self.log.warning("aborting the process group", error=str(exc))
            if self.backend == "gloo":     # gloo's abort wakes no blocked operation: its connections do
                sockets.shut_down(self._connections, self._store_ports())
                self._connections = set()
            return True

    def _store_ports(self) -> set[int]:
        ports = {getattr(self.store, "port", None), int(os.environ.get("MASTER_PORT", 0) or 0)}
        return {port for port in ports if port}

    # ------------------------------------------------------------------------------------- recovery
    def recover(self, cause: BaseException | str) -> dict[str, Any]:
        """Steps 1-5 of the module's docstring on this rank. Returns what happened and how long each part
        took (teardown_seconds, barrier_seconds, reform_seconds, failed_rank, cause, generation);
        RecoveryFailed when not every rank arrived in time or the group cannot be formed again."""
        generation = self.generation
        self._entered = generation
        began = time.perf_counter()
        text = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"[:500]
        try:
            mine = json.dumps({"rank": self.rank, "cause": text})
            written = self.store.compare_set(self._key(generation, "fault"), "", mine)
            first = json.loads(written.decode() if isinstance(written, bytes) else written)
        except Exception as exc:
            raise RecoveryFailed(f"the job's store cannot be reached ({exc}): no in-process restart") from exc
        self.abort(generation)
        torn_down = time.perf_counter()
        self._barrier(generation)
        met = time.perf_counter()
        with self._lock:
            self.generation = generation + 1
        try:
            self.form()
        except Exception as exc:
            raise RecoveryFailed(f"the process group could not be formed again: {exc}") from exc
        formed = time.perf_counter()
        if self.interrupt is not None:
            self.interrupt.disarm()
        if self.requests is not None:
            self.requests.settled()
        self._recovering = False
        asked = {"request": first["request"]} if first.get("request") else {}
        failed = replaced_rank(self.store, self._key(generation, "replaced")) or first
        if failed is not first:        # the rank that reported first only saw its peer's connection close
            asked["first_reported"] = {"rank": first.get("rank"), "cause": first.get("cause")}
        return {"generation": self.generation, "failed_rank": failed.get("rank"), "cause": failed.get("cause"),
                "teardown_seconds": torn_down - began, "barrier_seconds": met - torn_down,
                "reform_seconds": formed - met, **asked}

    def join(self, cause: str) -> dict[str, Any]:
        """A standby in a dead rank's place (runtime/resilience/standby.py): the surviving ranks are at, or
        on their way to, the current generation's barrier, waiting for `world_size` arrivals; this process
        arrives as the dead rank (writing the fault first, which wakes survivors that are not blocked on
        it), forms the next generation with them and starts its watcher. What `recover` returns."""
        try:
            self.generation = self._current_generation()
        except Exception as exc:
            raise RecoveryFailed(f"the job's store cannot be reached ({exc}): no in-process restart") from exc
        self._aborted = self.generation      # nothing of that generation was ever formed in this process
        try:
            self.store.set(self._key(self.generation, "replaced"), json.dumps({"rank": self.rank, "cause": cause}))
        except Exception as exc:
            raise RecoveryFailed(f"the job's store cannot be reached ({exc}): no in-process restart") from exc
        timings = self.recover(cause)
        self.replacing = False
        self.watch()
        return timings

    def _current_generation(self) -> int:
        """The generation the ranks are in: every recovery before it met (all `world_size` arrived), and
        the ranks re-form together, so it is the first one whose barrier is not complete."""
        generation = 0
        while self.store.check([self._key(generation, "fault")]) and \
                self.store.add(self._key(generation, "arrived"), 0) >= self.world:
            generation += 1
        return generation

    def _barrier(self, generation: int) -> None:
        key = self._key(generation, "arrived")
        try:
            self.store.add(key, 1)
            deadline = time.monotonic() + self.barrier_seconds
            pause = 0.005
            while (arrived := self.store.add(key, 0)) < self.world:
                if time.monotonic() > deadline:
                    raise RecoveryFailed(f"{arrived} of {self.world} ranks met in the store within "
                                         f"{self.barrier_seconds:g} s (recovery.barrier_seconds): the others are "
                                         "dead or hung; the launcher restarts every worker")
                time.sleep(pause)
                pause = min(pause * 2, 0.05)
        except RecoveryFailed:
            raise
        except Exception as exc:
            raise RecoveryFailed(f"the job's store cannot be reached ({exc}): no in-process restart") from exc

    def _key(self, generation: int, what: str) -> str:
        return f"{RECOVERY_PREFIX}/{generation}/{what}"

    def close(self) -> None:
        self._closed.set()
        if self._watcher is not None:
            self._watcher.join(timeout=1.0)


def replaced_rank(store: Any, key: str) -> dict[str, Any] | None:
    """The rank a standby took the place of in a generation (it writes `key` before it arrives at the
    barrier, so every rank past the barrier sees it): the rank that failed, whichever survivor reported
    first. None without one, or when the store cannot say (the record is a label; the recovery stands)."""
    try:
        if not store.check([key]):
            return None
        written = store.get(key)
        return json.loads(written.decode() if isinstance(written, bytes) else written)
    except Exception:
        return None
