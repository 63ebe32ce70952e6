"""Warm standbys: a rank whose process was killed is replaced by a process that has already imported torch.

torch's elastic launcher watches the process it started and restarts every worker of the job when one of
them dies. So with `recovery.mode: in_process` (and `recovery.standbys: 1`) the process it starts is a
small supervisor (trainer/train.py), not the rank:

    supervisor = Supervisor(run_rank=..., replace_rank=..., max_promotions=3, log=log)
    code = supervisor.run()        # forks the rank and its standby; returns the rank's exit code

- after `import torch` (and before any thread, CUDA context, store connection or process group exists in
  it: fork copies only the calling thread) it forks the **rank**, which runs as it always did, and one
  **standby**, which blocks reading a pipe. Both are its children: it reaps them, it alone knows their
  exit status, and Linux ends both when it dies (PR_SET_PDEATHSIG);
- when the rank dies by a signal (SIGKILL, the OOM killer, a segfault; not SIGTERM, SIGINT or SIGHUP,
  which ask it to stop) while the supervisor is not being stopped, it writes the rank's identity (`hand_over`: rank, local rank, world size, the store's address)
  on the standby's pipe. The standby (`replace_rank`) builds the trainer, joins the barrier the surviving
  ranks wait at in the job's store (runtime/resilience/inprocess.py `ProcessGroups.join`: it reads the
  recovery generation there), forms the new group with them, and restores what they restore (the newest
  in-memory snapshot every rank verifies: its own on this node's /dev/shm, the dead process's files);
- only then, off the critical path, it forks the next standby;
- a rank that exits (any status) ends the supervisor with that status; a rank killed by a signal that
  cannot be replaced (no standby, `max_promotions` spent, the supervisor being stopped) ends it by the same
  signal, so the launcher sees what it saw without a supervisor and restarts every worker;
- SIGTERM, SIGINT and SIGHUP to the supervisor go on to the rank and the standby; it waits for the rank.

One standby per rank, not per node: forked from the supervisor after the import, a waiting standby shares
its pages copy-on-write (docs/recovery.md "Warm standbys" has what it costs), and as a child of the rank's
own supervisor it needs no claim across processes, its exit status reaches the supervisor that reports
it, and two ranks of one node killed at once (the OOM killer) are both replaced.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import time
import traceback
from typing import Any, Callable

SUPERVISOR_ENV = "TRAINGUARD_SUPERVISOR_PID"   # set in the rank and the standby: their registration reads it
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
IDENTITY = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# What the rank's path imports on first use, imported once in the supervisor before it forks, so neither the
# rank nor a promoted standby pays for it (torch.optim's first optimizer imports torch._dynamo: seconds).
# Imports only: no tensor op (it could start a thread pool that a forked child would inherit broken).
WARM_MODULES = ("torch._dynamo", "torch.nn.parallel", "torch.distributed.checkpoint")
REMEMBERED = "trainguard/standby"     # the job store's keys of what the ranks gathered at start
MAX_STANDBY_FAILURES = 3      # standbys that died unpromoted before the supervisor stops forking them


def warm_up(modules: tuple[str, ...] = WARM_MODULES) -> None:
    import importlib

    for name in modules:
        importlib.import_module(name)


def remember(groups: Any, name: str, value: Any) -> None:
    """Keep what the ranks gathered when they started (rank 0 writes it in the job's store): a standby in
    a killed rank's place cannot gather it again, as the others do not take part."""
    groups.store.set(f"{REMEMBERED}/{name}", json.dumps(value))


def recall(groups: Any, name: str) -> Any:
    """What `remember` kept (the store's get waits for it up to the store's timeout)."""
    raw = groups.store.get(f"{REMEMBERED}/{name}")
    return json.loads(raw.decode() if isinstance(raw, bytes) else raw)


def hand_over(environ: Any = os.environ) -> dict[str, str]:
    """The dead rank's identity, as the standby takes it on (the launcher's variables of this worker)."""
    return {name: environ[name] for name in IDENTITY if name in environ}


class Supervisor:
    def __init__(self, run_rank: Callable[[], int], replace_rank: Callable[[dict], int], *,
                 max_promotions: int, log: Any, standbys: int = 1, warm_modules: tuple[str, ...] = WARM_MODULES):
        """`run_rank()`: the rank's whole life in the forked child, returning its exit code;
        `replace_rank(identity)`: the same for a standby promoted in a dead rank's place."""
        self.run_rank, self.replace_rank, self.warm_modules = run_rank, replace_rank, warm_modules
        self.max_promotions, self.log, self.standbys = max_promotions, log, standbys
        self.rank_pid: int | None = None
        self.standby_pid: int | None = None
        self._standby_pipe: int | None = None      # the write end of the standby's pipe
        self.promotions = 0
        self._standby_failures = 0
        self._stopping: int | None = None          # the signal the supervisor was told to stop with

    # ----------------------------------------------------------------------------------------- running
    def run(self) -> int:
        """Fork the rank and its standby, supervise them; the rank's exit code. A rank that died by a
        signal and cannot be replaced ends this process by the same signal (it does not return)."""
        os.environ[SUPERVISOR_ENV] = str(os.getpid())
        warm_up(self.warm_modules)
        gc.freeze()     # what is here now is the children's too: their collections must not copy its pages
        for sig in FORWARDED:
            signal.signal(sig, self._forward)
        self.rank_pid = self._fork(self.run_rank)
        self._fork_standby()
        while True:
            pid, status = _wait_any()
            if pid == self.rank_pid:
                if os.WIFSIGNALED(status) and self._promote(os.WTERMSIG(status)):
                    continue
                self._end_standby()
                if os.WIFSIGNALED(status):
                    _die_by(os.WTERMSIG(status))
                return os.waitstatus_to_exitcode(status)
            if pid == self.standby_pid:
                self._standby_died(status)

    def _promote(self, sig: int) -> bool:
        """Hand the dead rank's place to the standby; whether it was handed."""
        why = ("the supervisor is stopping" if self._stopping is not None
               else f"it was told to stop ({signal.Signals(sig).name})" if sig in FORWARDED
               else f"{self.promotions} promotions (the budget) spent" if self.promotions >= self.max_promotions
               else "no standby" if self.standby_pid is None
               else None)
        if why is not None:
            self.log.error("the rank was killed and is not replaced: the launcher restarts every worker",
                           pid=self.rank_pid, signal=signal.Signals(sig).name, why=why)
            return False
        began = time.perf_counter()
        identity = hand_over()
        try:
            os.write(self._standby_pipe, (json.dumps(identity) + "\n").encode())
        except OSError as exc:      # the standby died a moment ago: its exit is reaped next
            self.log.error("the standby could not take the rank's place", error=str(exc))
            return False
        os.close(self._standby_pipe)
        dead, self.rank_pid = self.rank_pid, self.standby_pid
        self.standby_pid = self._standby_pipe = None
        self.promotions += 1
        self.log.warning("the rank was killed: its standby takes its place", dead_pid=dead, pid=self.rank_pid,
                         signal=signal.Signals(sig).name, promotion=self.promotions,
                         handover_seconds=round(time.perf_counter() - began, 6), **identity)
        self._fork_standby()     # the next one, while the promoted rank is already on its way
        return True

    def _standby_died(self, status: int) -> None:
        self.standby_pid = None
        if self._standby_pipe is not None:
            os.close(self._standby_pipe)
            self._standby_pipe = None
        if self._stopping is not None:
            return
        self._standby_failures += 1
        self.log.error("the standby ended before it was needed", status=os.waitstatus_to_exitcode(status),
                       failures=self._standby_failures)
        if self._standby_failures < MAX_STANDBY_FAILURES:
            self._fork_standby()

    # ---------------------------------------------------------------------------------------- children
    def _fork_standby(self) -> None:
        if self.standbys < 1 or self.promotions >= self.max_promotions or self._stopping is not None:
            return
        read_end, write_end = os.pipe()
        self.standby_pid = self._fork(lambda: self._wait_for_the_call(read_end), close=write_end)
        os.close(read_end)
        self._standby_pipe = write_end

    def _wait_for_the_call(self, read_end: int) -> int:
        """The standby's life: block until the supervisor hands it a rank (or closes the pipe: exit 0)."""
        line = b""
        while not line.endswith(b"\n"):
            chunk = os.read(read_end, 4096)     # a pipe from the supervisor: no file is read
            if not chunk:
                return 0            # never called: the rank's job is over
            line += chunk
        os.close(read_end)
        identity = json.loads(line)
        os.environ.update(identity)
        return self.replace_rank(identity)

    def _fork(self, life: Callable[[], int], close: int | None = None) -> int:
        supervisor = os.getpid()
        sys.stdout.flush()      # what is buffered would be written twice, once by each process
        sys.stderr.flush()
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:
            _child_of(supervisor, close)
            code = life()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)      # never back into the supervisor's loop, nor through the interpreter's teardown
        raise AssertionError("unreachable")

    # ----------------------------------------------------------------------------------------- signals
    def _forward(self, sig: int, frame: Any) -> None:
        self._stopping = sig
        for pid in (self.rank_pid, self.standby_pid):
            if pid is not None:
                _signal(pid, sig)

    def _end_standby(self) -> None:
        if self.standby_pid is None:
            return
        _signal(self.standby_pid, signal.SIGKILL)     # it holds nothing: no group, no file, no snapshot
        try:
            os.waitpid(self.standby_pid, 0)
        except ChildProcessError:
            pass
        self.standby_pid = None
        if self._standby_pipe is not None:
            os.close(self._standby_pipe)
            self._standby_pipe = None


def _child_of(supervisor: int, close: int | None) -> None:
    """In a freshly forked child: default signal handlers, the supervisor's end of the pipe closed, and die
    with the supervisor (a rank or standby without it could never report to the launcher, and would hold
    its memory and GPU forever)."""
    if close is not None:
        os.close(close)
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != supervisor:      # it died before prctl took effect
        os._exit(1)


def _wait_any() -> tuple[int, int]:
    while True:
        try:
            return os.waitpid(-1, 0)
        except InterruptedError:      # a forwarded signal; PEP 475 retries, older paths may not
            continue


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _die_by(sig: int) -> None:
    """End this process by `sig`, as its rank ended: the launcher sees the same death."""
    sys.stdout.flush()
    sys.stderr.flush()
    if sig not in (signal.SIGKILL, signal.SIGSTOP):     # the two that cannot be handled
        signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    time.sleep(5)                      # a signal that does not end a process by default (none forwarded here)
    os._exit(128 + sig)
