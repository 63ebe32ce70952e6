"""The `restore` action's hands: prove which processes are this node's trainer ranks, and end those.

Each rank registers in ``RUN/control/ranks/rank-<r>.json`` (runtime/control.py `write_rank_file`; the
fields are documented in docs/agent.md). Ending the ranks is all the agent does: torch's elastic launcher
(torchrun, or ``trainguard train --nproc K``) sees its workers fail, starts them again, and they resume
from the newest verified checkpoint.

A rank file is a claim, written into a directory other people may be able to write. The agent signals a
process only when the process itself proves the claim (`prove_rank`), from what the kernel says about it:

- it is alive, on this host, and its start time equals the registered ``create_time`` to the clock tick
  (so a reused pid, or a pid copied into the file, fails);
- it runs under the expected uid (the agent's own; the run directory's owner when the agent is root);
- it is a worker of this run: it holds this run's ``tls/rank-<r>.jsonl`` open for writing (`holds_rank_log`:
  every loop on trainguard.protect does, so a user's script needs no configuration), or its command line is
  trainguard's worker entry point (``-m trainguard.trainer.train``) or an entry point the operator
  registered in the agent config (``webhook.restore_entry_points``), naming this run directory
  (``--run-dir RUN`` or ``TRAINGUARD_RUN_DIR=RUN`` in its environment);
- it descends from a launcher the agent can identify (torchrun / torch.distributed.run, ``trainguard
  train``, ``accelerate launch``, ``fabric run``, or one registered in ``webhook.restore_launchers``),
  under the same uid, and that launcher is
  the one the rank registered (``launcher_pid``, ``launcher_create_time``): with no launcher nothing would
  start the rank again, so ending it would only end the run.

Anything else is refused with a reason (`REFUSALS`), logged and counted
(``trainguard_restore_refused_total{reason}``), never signalled. A proven rank whose launcher has no
restarts left (``restarts_left: 0``) is not ended either: the restore pages a human instead.

SIGKILL by default. A rank hung inside a collective never returns to the interpreter, so it cannot run
a SIGTERM handler, and a signalled rank that lingers while the launcher already starts the next attempt
can break that attempt's rendezvous (seen here with gloo: the new ranks fail to connect, or hang).
Nothing is lost: every TLS record is on disk as it is written, and the ranks resume from the latest
verified checkpoint. With a grace period (``webhook.restore_grace_seconds``), SIGTERM first and SIGKILL
after it.
"""

from __future__ import annotations

import os
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from trainguard import log as tglog
from trainguard import rundir
from trainguard.agent.procfs import pid_namespaces, registered_start
from trainguard.rundir import RankInfo, read_ranks  # noqa: F401  (read_ranks: agent/culprit.py asks for it here)
from trainguard.rundir import RankFiles  # noqa: F401  (moved to trainguard/rundir.py; this name still works)

BUNDLED_ENTRY_POINT = "trainguard.trainer.train"
BUNDLED_LAUNCHERS = ("torchrun", "torch.distributed.run", "torch.distributed.launch", "accelerate-launch",
                     "accelerate.commands.launch")
# Launchers that are one subcommand of a command-line tool: `trainguard train --nproc K`, `accelerate
# launch` and Lightning's `fabric run` (`lightning run` before 2.2); each runs torch's elastic agent in its
# own process, so that process is the workers' parent.
SUBCOMMAND_LAUNCHERS = {"trainguard": "train", "trainguard.cli": "train", "accelerate": "launch",
                        "fabric": "run", "lightning": "run"}
RUN_DIR_ENV = "TRAINGUARD_RUN_DIR"
TICK = 1.0 / os.sysconf("SC_CLK_TCK")      # the resolution of a process's start time in /proc
MAX_ANCESTORS = 8                           # srun -> torchrun -> worker is three; a shell or two more

# Why a registered rank was not signalled: the label values of trainguard_restore_refused_total.
REFUSALS = {
    "no_start_time": "the rank file has no create_time to prove the process by",
    "start_time_mismatch": "the process's start time differs from the registered one (a reused or copied pid)",
    "wrong_uid": "the process runs under another uid than the run's",
    "unreadable": "the process's command line or environment cannot be read",
    "not_a_worker": "the process runs no registered worker entry point",
    "other_run": "the worker names another run directory (or none)",
    "no_launcher": "no identifiable launcher among the process's ancestors: nothing would restart it",
    "launcher_mismatch": "the launcher is not the one the rank registered",
    "no_restarts_left": "the launcher has no restarts left (a human is paged instead)",
    "ambiguous_pod_pid": "several processes of this node match the pod's pid and start time",
}


def live_process(info: RankInfo) -> psutil.Process | None:
    """The rank's process if it is alive and not younger than its rank file (a liveness check for the
    collectors and the watchdog; `prove_rank` is the check before a signal)."""
    try:
        process = psutil.Process(info.pid)
        if process.create_time() > info.started_at + 1.0:
            return None    # the pid was reused by a younger process
        return process
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def local_ranks(infos: list[RankInfo], host: str) -> list[tuple[RankInfo, psutil.Process]]:
    """This host's ranks (of the rank files `infos`) whose processes are alive."""
    return [(info, process) for info in infos if info.host == host
            for process in [live_process(info)] if process is not None]


# ----------------------------------------------------------------------- this host's registrations

class SharedRankFiles(RankFiles):
    """A `RankFiles` that several threads of one agent read: the stall watchdog every few seconds
    (agent/actions_embedded.py), the actions (restore, eviction) when they run."""

    def __init__(self, run_dir: str | Path, hosts, adopt=None):
        super().__init__(run_dir, hosts, adopt)
        self._lock = threading.Lock()

    def read(self) -> list[RankInfo]:
        with self._lock:
            return super().read()


_SHARED: dict[tuple[str, str], SharedRankFiles] = {}
_SHARED_LOCK = threading.Lock()
MAX_SHARED = 8          # (run directory, host) pairs a process follows: one in an agent, more in tests


def host_rank_files(run_dir: str | Path, host: str) -> SharedRankFiles:
    """This process's one reader of `host`'s registrations in `run_dir`."""
    key = (os.path.abspath(run_dir), host)
    with _SHARED_LOCK:
        files = _SHARED.pop(key, None) or SharedRankFiles(run_dir, {host}, pid_namespaces(run_dir, host).adopt)
        _SHARED[key] = files                      # the newest last; the oldest past MAX_SHARED forgotten
        while len(_SHARED) > MAX_SHARED:
            del _SHARED[next(iter(_SHARED))]
    return files


def host_ranks(run_dir: str | Path, host: str) -> tuple[list[RankInfo], list[str]]:
    """`host`'s registrations and the unreadable files: `read_ranks` for what needs this node's ranks only.

    The host is inside each file, so a process reads every registration once; after that only the new
    and changed ones (rundir.RankFiles). The stall watchdog reads the same reader every few seconds, so
    by the time an action runs it is current: the action opens at most this node's changed files, not
    8,000 at 1,000 nodes. What it returns is what `read_ranks` gives filtered to `host`, as of the last
    change of RUN/control/ranks (each action still proves every process before signalling it)."""
    files = host_rank_files(run_dir, host)
    infos = files.read()
    return list(infos), files.problems


# ------------------------------------------------------------------------------------------ the proof

@dataclass(frozen=True)
class Trust:
    """What this agent accepts as a rank of its run: from the operator's config, never from a rank file."""

    run_dir: Path
    uid: int
    entry_points: tuple[str, ...] = (BUNDLED_ENTRY_POINT,)
    launchers: tuple[str, ...] = BUNDLED_LAUNCHERS

    @classmethod
    def for_run(cls, run_dir: str | Path, entry_points=(), launchers=()) -> "Trust":
        run_dir = Path(run_dir).resolve()
        return cls(run_dir, expected_uid(run_dir), (BUNDLED_ENTRY_POINT, *entry_points),
                   (*BUNDLED_LAUNCHERS, *launchers))


def expected_uid(run_dir: Path) -> int:
    """The agent's own uid; when it runs as root, the run directory's owner (root only if root owns it)."""
    uid = os.geteuid()
    return uid if uid != 0 else os.stat(run_dir).st_uid


class Refused(Exception):
    def __init__(self, reason: str, detail: str = ""):
        assert reason in REFUSALS, reason
        self.reason, self.detail = reason, detail or REFUSALS[reason]
        super().__init__(f"{reason}: {self.detail}")


@dataclass(frozen=True)
class Proof:
    process: psutil.Process
    launcher: psutil.Process
    evidence: dict = field(default_factory=dict)
    supervisor: psutil.Process | None = None     # the rank's supervisor, ended with it (`_supervisor`)


def prove_rank(info: RankInfo, trust: Trust) -> Proof | None:
    """The rank's process, proven to be a worker of this run under a launcher; None when it is not running.

    Raises `Refused` (with a reason of `REFUSALS`) when a live process does not prove the claim. The
    caller has already checked the host.
    """
    if info.ns_candidates > 1:
        raise Refused("ambiguous_pod_pid", f"pid {info.ns_pid} of {info.ns_host}: {info.ns_candidates} "
                                           "processes here match it, none by its host name")
    try:
        process = psutil.Process(info.pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        created = process.create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:
        raise Refused("unreadable", f"pid {info.pid}: access denied") from None
    if info.create_time is None:
        raise Refused("no_start_time")
    if not same_tick(created, registered_start(info.create_time, info.boot_time, psutil.boot_time())):
        raise Refused("start_time_mismatch", f"started at {created:.2f}, registered {info.create_time:.2f}"
                                             + _since_boot(created, info))
    _check_uid(process, trust, info)
    cmdline, environ = _identity(process)
    if holds_rank_log(process.pid, trust.run_dir, info.rank):
        # any loop on trainguard.protect (a user's script under torchrun, accelerate launch, fabric run):
        # the kernel shows it appending to this run's log of this rank, which no other process does (the
        # open file's inode, whatever path the process's own mount namespace gives it)
        entry_point = f"holds {rundir.rank_log(trust.run_dir, info.rank).relative_to(trust.run_dir)}"
    else:
        entry_point = worker_entry_point(cmdline, trust.entry_points)
        if entry_point is None:
            raise Refused("not_a_worker", f"command line {' '.join(cmdline)[:200]!r}, and it does not hold "
                                          f"tls/rank-{info.rank}.jsonl of this run open")
        named = _named_run_dir(cmdline, environ, process)
        if named != trust.run_dir and not _same_dir_seen_from(process, named, trust.run_dir):
            raise Refused("other_run", f"{entry_point} names {named or 'no run directory'}, not {trust.run_dir}")
    launcher = _launcher(process, trust, info)
    supervisor = _supervisor(process, launcher, trust)
    return Proof(process, launcher, {"entry_point": entry_point, "launcher_pid": launcher.pid, "uid": trust.uid,
                                     **({"supervisor_pid": supervisor.pid} if supervisor else {})}, supervisor)


def holds_rank_log(pid: int, run_dir: Path, rank: int) -> bool:
    """Whether process `pid` holds this run's `tls/rank-<rank>.jsonl` open for writing, as the kernel says
    (/proc/PID/fd): the open file's device and inode against the log's, and the descriptor's access mode.

    A Protector (every integration, and the bundled trainer) appends to that file through one descriptor
    for its whole life. The log must be a plain file with one link, in the run directory's own tls/ folder:
    a symlink or hard link planted there, or a tls/ that leads elsewhere, would point the proof at another
    process's file, so any of those proves nothing."""
    log = rundir.rank_log(run_dir, rank)
    try:
        if os.path.realpath(log.parent) != os.path.join(os.path.realpath(run_dir), log.parent.name):
            return False
        wanted = os.lstat(log)
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    if not stat.S_ISREG(wanted.st_mode) or wanted.st_nlink != 1:
        return False
    for fd in fds:
        try:
            held = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue          # closed since the listing, or not a file
        if (held.st_dev, held.st_ino) == (wanted.st_dev, wanted.st_ino) and _open_for_writing(pid, fd):
            return True
    return False


def _open_for_writing(pid: int, fd: str) -> bool:
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}") as handle:
            flags = next((line.split()[1] for line in handle if line.startswith("flags:")), None)
    except OSError:
        return False
    return flags is not None and int(flags, 8) & os.O_ACCMODE != os.O_RDONLY


def same_tick(a: float, b: float) -> bool:
    """Two start times of one process agree to the kernel's clock tick (psutil derives them from it)."""
    return abs(a - b) <= TICK + 1e-6


def _since_boot(created: float, info: RankInfo) -> str:
    if info.boot_time is None or info.create_time is None:
        return ""
    return f" ({created - psutil.boot_time():.2f} s and {info.create_time - info.boot_time:.2f} s after boot)"


def _check_uid(process: psutil.Process, trust: Trust, info: RankInfo) -> None:
    try:
        uids = process.uids()
    except psutil.Error:
        raise Refused("unreadable", f"pid {info.pid}: uid") from None
    if uids.real != trust.uid or uids.effective != trust.uid:
        raise Refused("wrong_uid", f"pid {info.pid} runs as uid {uids.real}, the run's is {trust.uid}")
    if info.uid is not None and info.uid != trust.uid:
        raise Refused("wrong_uid", f"the rank file says uid {info.uid}, the run's is {trust.uid}")


def _identity(process: psutil.Process) -> tuple[list[str], dict]:
    try:
        return process.cmdline(), process.environ()
    except psutil.Error as exc:
        raise Refused("unreadable", f"pid {process.pid}: {type(exc).__name__}") from None


def worker_entry_point(cmdline: list[str], entry_points: tuple[str, ...]) -> str | None:
    """The registered entry point `cmdline` runs (a module after ``-m``, or a script path), else None.

    Only the program's own position counts (``python -m X`` or ``python [opts] SCRIPT``), not any word of
    the command line, so ``sleep 900 trainguard.trainer.train`` is no worker.
    """
    program = _program(cmdline)
    if program is None:
        return None
    for entry in entry_points:
        if program == entry or (entry.endswith(".py") or "/" in entry) and _same_file(program, entry):
            return entry
    return None


def _program(cmdline: list[str]) -> str | None:
    """What a Python command line runs: the module of ``-m M``, or the script; a non-Python program itself."""
    if not cmdline:
        return None
    if "python" not in os.path.basename(cmdline[0]):
        return cmdline[0]
    args = iter(cmdline[1:])
    for arg in args:
        if arg == "-m":
            return next(args, None)
        if arg.startswith("-m") and len(arg) > 2:
            return arg[2:]
        if arg in ("-c", "-"):
            return None           # code on the command line proves nothing
        if arg in ("-W", "-X", "--check-hash-based-pycs"):
            next(args, None)
            continue
        if not arg.startswith("-"):
            return arg
    return None


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.basename(a) == os.path.basename(b) and not os.path.isabs(b)


def _named_run_dir(cmdline: list[str], environ: dict, process: psutil.Process) -> Path | None:
    """The run directory the process names: ``--run-dir X`` / ``--run-dir=X``, else ``TRAINGUARD_RUN_DIR``."""
    value = None
    for index, arg in enumerate(cmdline):
        if arg == "--run-dir" and index + 1 < len(cmdline):
            value = cmdline[index + 1]
        elif arg.startswith("--run-dir="):
            value = arg.split("=", 1)[1]
    value = value or environ.get(RUN_DIR_ENV)
    if not value:
        return None
    path = Path(value)
    if not path.is_absolute():
        try:
            path = Path(process.cwd()) / path
        except psutil.Error:
            return None
    return path.resolve()


def _same_dir_seen_from(process: psutil.Process, named: Path | None, run_dir: Path) -> bool:
    """The process's `named` directory, through its own root (/proc/<pid>/root: a pod's mounts), is the run
    directory: a rank in a pod names its run directory as its pod mounts it, the agent as its own pod does."""
    if named is None:
        return False
    try:
        return os.path.samefile(f"/proc/{process.pid}/root{named}", run_dir)
    except OSError:
        return False


def _launcher(process: psutil.Process, trust: Trust, info: RankInfo) -> psutil.Process:
    """The nearest ancestor that is an identifiable launcher, checked against the registration."""
    try:
        ancestors = process.parents()[:MAX_ANCESTORS]
    except psutil.Error:
        ancestors = []
    for ancestor in ancestors:
        try:
            if not is_launcher(ancestor.cmdline(), trust.launchers):
                continue
            if ancestor.uids().real != trust.uid:
                raise Refused("wrong_uid", f"launcher pid {ancestor.pid} runs as uid {ancestor.uids().real}")
            created = ancestor.create_time()
        except psutil.Error:
            continue
        if info.launcher_pid is not None and (ancestor.pid != info.launcher_pid or (
                info.launcher_create_time is not None and
                not same_tick(created, registered_start(info.launcher_create_time, info.boot_time,
                                                        psutil.boot_time())))):
            raise Refused("launcher_mismatch", f"launcher pid {ancestor.pid}, registered {info.launcher_pid}")
        return ancestor
    raise Refused("no_launcher")


def _supervisor(process: psutil.Process, launcher: psutil.Process, trust: Trust) -> psutil.Process | None:
    """The proven rank's supervisor (runtime/resilience/standby.py), when a supervisor forked it: its
    parent, itself this run's worker entry point under the same uid, whose own parent is the rank's
    launcher. It is ended with the rank: alive, it would put its warm standby in the rank's place instead
    of letting the launcher restart the workers, which is what a restore asks for. None when the parent
    is the launcher or anything else (a shell between them is left alone, as before)."""
    try:
        parent = process.parent()
        if parent is None or parent.pid == launcher.pid:
            return None
        above = parent.parent()
        if above is None or above.pid != launcher.pid or parent.uids().real != trust.uid:
            return None
        cmdline, environ = parent.cmdline(), parent.environ()
    except psutil.Error:
        return None
    if worker_entry_point(cmdline, trust.entry_points) is None:
        return None
    named = _named_run_dir(cmdline, environ, parent)
    if named != trust.run_dir and not _same_dir_seen_from(parent, named, trust.run_dir):
        return None
    return parent


def is_launcher(cmdline: list[str], launchers: tuple[str, ...]) -> bool:
    """torchrun (or a registered launcher) by program, or a tool's launching subcommand
    (`SUBCOMMAND_LAUNCHERS`: ``trainguard train``, ``accelerate launch``, ``fabric run``)."""
    program = _program(cmdline)
    if program is None:
        return False
    if program in launchers or os.path.basename(program) in launchers:
        return True
    subcommand = SUBCOMMAND_LAUNCHERS.get(program, SUBCOMMAND_LAUNCHERS.get(os.path.basename(program)))
    if subcommand is not None:
        rest = cmdline[cmdline.index(program) + 1:] if program in cmdline else []
        return next((arg for arg in rest if not arg.startswith("-")), None) == subcommand
    return False


# ----------------------------------------------------------------------------------------- ending ranks

def end_local_ranks(run_dir: str | Path, host: str, started_before: float | None = None,
                    grace_seconds: float = 0.0, trust: Trust | None = None) -> dict:
    """End this host's proven ranks that started before `started_before`.

    Returns ``{"ended": [...], "skipped": [...], "refused": [...]}`` and, when a proven rank's launcher
    has no restarts left, ``"paged"`` instead of ending anything: a restore must never end a run that
    cannot restart.
    """
    log = tglog.get("agent.restore", host=host)
    trust = trust or Trust.for_run(run_dir)
    infos, problems = host_ranks(run_dir, host)     # this node's ranks only: other nodes' are theirs to end
    skipped, refused, proven = [], [], []
    for info in infos:
        why = _reason_to_spare(info, host, started_before)
        try:
            proof = None if why else prove_rank(info, trust)
        except Refused as refusal:
            refused.append({"rank": info.rank, "pid": info.pid, "reason": refusal.reason, "detail": refusal.detail})
            log.error("restore refused: not a proven rank of this run", rank=info.rank, pid=info.pid,
                      reason=refusal.reason, detail=refusal.detail, rank_file=str(info.path))
            continue
        if why is None and proof is None:
            why = "not running"
        if why:
            skipped.append({"rank": info.rank, "pid": info.pid, "why": why})
            continue
        proven.append((info, proof))
    for problem in problems:
        log.warning("rank file unreadable", error=problem)
    result = {"skipped": skipped, "refused": refused, **({"problems": problems} if problems else {})}
    stuck = [info for info, _ in proven if not info.restarts_left]
    if stuck:
        return {**result, "ended": [], "paged": _page(stuck, log)}
    return {**result, "ended": _signal([proof for _, proof in proven], [i for i, _ in proven],
                                       grace_seconds, log, skipped)}


def _page(stuck: list[RankInfo], log) -> dict:
    evidence = {"reason": "no_restarts_left", "ranks": [i.rank for i in stuck],
                "restarts_left": {str(i.rank): i.restarts_left for i in stuck}}
    log.error("restore not carried out: the launcher has no restarts left, ending the ranks would end the "
              "run; a human must look", **evidence)
    return evidence


def _signal(proofs: list[Proof], infos: list[RankInfo], grace_seconds: float, log,
            skipped: list) -> list[dict]:
    ended, signalled = [], []
    for proof, info in zip(proofs, infos):
        # the supervisor first: it must not hand the rank's place to its standby (it ends both as it ends)
        for process in (proof.supervisor, proof.process) if proof.supervisor else (proof.process,):
            try:
                process.kill() if grace_seconds <= 0 else process.terminate()
            except psutil.NoSuchProcess:
                continue
            signalled.append(process)
        if proof.process not in signalled:
            skipped.append({"rank": info.rank, "pid": info.pid, "why": "exited"})
            continue
        ended.append({"rank": info.rank, "pid": info.pid,
                      **({"supervisor_pid": proof.supervisor.pid} if proof.supervisor else {})})
    if signalled and grace_seconds > 0:
        timer = threading.Timer(grace_seconds, _kill_survivors, (signalled, log))
        timer.daemon = True
        timer.start()
    return ended


def _reason_to_spare(info: RankInfo, host: str, started_before: float | None) -> str | None:
    if info.host != host:
        return f"on host {info.host}"
    if started_before is not None and info.started_at >= started_before:
        return "started after the alert began"
    return None


def _kill_survivors(victims: list[psutil.Process], log) -> None:
    for process in victims:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                process.kill()     # psutil checks the pid still names the same process
                log.warning("rank ignored SIGTERM; killed", pid=process.pid)
        except psutil.Error:
            continue
