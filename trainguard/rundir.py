"""The run directory: every path in it, and both ends of the files the trainer and the agent exchange.

    RUN/tls/rank-<r>.jsonl                 the trainer's TLS log per rank
    RUN/tls/node-<node>.jsonl              the agent's node log
    RUN/tls/node-<node>-actions.jsonl      the agent's decisions and actions, each record signed (agent/executor.py)
    RUN/checkpoints/step_<N>/              verified checkpoints (runtime/checkpoint/)
    RUN/checkpoints/status.json            the last save's outcome (runtime/checkpoint/manager.py writes it)
    RUN/policy.yaml                        the policy the run trains with, signed by rank 0 (trainguard/runpolicy.py)
    RUN/policy.sig.json                    its signature: which bytes, which run, which key (trainguard/runpolicy.py)
    RUN/preflight.json                     `trainguard preflight`'s result (runtime/preflight_result.py)
    RUN/report.html                        `trainguard report` (trainguard/report/)
    RUN/agent/offsets-<node>.json          the training collector's offsets and state, signed (agent/collectors/training.py)
    RUN/agent/webhook.token                the webhook's bearer token, when none is configured (agent/executor.py)
    RUN/agent/hosts/<host>.json            a pod host name an agent found among its node's processes (agent/procfs.py)
    RUN/incidents/<id>/                    incidents and their evidence, signed by the agents (trainguard/incidents/__init__.py)
    RUN/control/actions.jsonl              requests, signed: the agent writes (`sign_request`, `append_request`), rank 0 reads (`Requests`, `check_request`)
    RUN/control/acked.jsonl                request ids the trainer handled (`append_ack`, `read_acked`)
    RUN/control/claims/<request id>        which agent carries out a job-level action (agent/claims.py, signed)
    RUN/control/claims/<id>.takeover-<g>-<tag>   a claim taken over from a claimant that did not finish
    RUN/tls/node-<host>-launcher.jsonl     the launcher's events (a cordon it did not honour)
    RUN/control/recovery/<id>.json         an agent's request to recover in-process, signed (runtime/resilience/request.py)
    RUN/control/recovery/<id>.rank-<r>.ack a rank's watcher took that request (the agent waits for the result then)
    RUN/control/ranks/rank-<r>.json        each rank's registration (`write_rank_file`, `read_ranks`; an agent: `RankFiles`)
    RUN/control/cordon/<host>              a node kept out of the job, when signed (trainguard/cordon/__init__.py)
    RUN/control/launchers/<host>.json      each node's elastic launcher (trainer/launch.py)
    RUN/control/dump/<incident>.json       a Flight Recorder dump request (runtime/flight_recorder.py)
    RUN/control/faults-fired.jsonl         injected faults that already fired (trainer/faults.py)
    RUN/control/stopped.json               the run stopped for good, signed by rank 0 (protect/protector.py)
    RUN/config.yaml                        what every worker trains with (trainer/cli.py; its digest on their command line)
    RUN/logs/                              each rank's output, as torchrun --log-dir keeps it (trainer/launch.py)
    RUN/cost_summary.json                  what a cost_stop spent and kept (protect/protector.py)

Who writes and reads each, how a reader knows it is genuine, and what a forged one does: docs/reliability.md,
"Every file under RUN". The layout is the on-disk contract (docs/architecture.md, "Run directory and the
control channel"); every module asks here for a path instead of spelling it (tests/test_vocabulary.py). Files whose content another module owns (claims, cordons, launchers, dumps)
get their path here and their content there. No torch, no psutil: the core, the agent and the trainer all
import this module.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path

from trainguard import safe_read, signed

PathLike = str | os.PathLike
CHECKPOINT_STATUS_FILE = "status.json"
CHECKPOINT_MANIFEST = "manifest.json"      # in each step_<N>/ (its content: runtime/checkpoint/manifest.py)
STEP_DIR_PREFIX = "step_"                  # a checkpoint's directory is step_<N>
_STEP_DIR = re.compile(r"step_([0-9]+)")
LOGS_DIR = "logs"                          # relative to the run directory (the nccl collector's default globs)


# ------------------------------------------------------------------------------------------- paths

def tls_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / "tls"


def rank_log(run_dir: PathLike, rank: int) -> Path:
    return tls_dir(run_dir) / f"rank-{rank}.jsonl"


def node_log(run_dir: PathLike, node: str) -> Path:
    return tls_dir(run_dir) / f"node-{node}.jsonl"


def node_actions_log(run_dir: PathLike, node: str) -> Path:
    return tls_dir(run_dir) / f"node-{node}-actions.jsonl"


def checkpoints_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir_name(step: int) -> str:
    """`step_<N>`: the name of step N's checkpoint directory, also how a TLS record names its last checkpoint."""
    return f"{STEP_DIR_PREFIX}{step}"


def step_of_dir(name: str) -> int | None:
    """N of a `step_<N>` directory name (ASCII digits only); None for any other name."""
    match = _STEP_DIR.fullmatch(name)
    return int(match.group(1)) if match else None


def step_dir(run_dir: PathLike, step: int) -> Path:
    return checkpoints_dir(run_dir) / step_dir_name(step)


def checkpoint_status_path(run_dir: PathLike) -> Path:
    return checkpoints_dir(run_dir) / CHECKPOINT_STATUS_FILE


def policy_path(run_dir: PathLike) -> Path:
    return Path(run_dir) / "policy.yaml"


def policy_signature_path(run_dir: PathLike) -> Path:
    return Path(run_dir) / "policy.sig.json"


def config_path(run_dir: PathLike) -> Path:
    return Path(run_dir) / "config.yaml"


def preflight_path(run_dir: PathLike) -> Path:
    return Path(run_dir) / "preflight.json"


def report_path(run_dir: PathLike) -> Path:
    return Path(run_dir) / "report.html"


def agent_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / "agent"


def host_claim(run_dir: PathLike, host: str) -> Path:
    """RUN/agent/hosts/<host>.json: the node whose agent found `host`'s ranks among its processes (a pod's
    host name mapped to its node, agent/procfs.py `PidNamespaces`). Only the warning about ranks of no
    known node reads it: it decides nothing."""
    return agent_dir(run_dir) / "hosts" / f"{host}.json"


def offsets_path(run_dir: PathLike, node: str) -> Path:
    return agent_dir(run_dir) / f"offsets-{node}.json"


def health_state_path(run_dir: PathLike, node: str) -> Path:
    """RUN/agent/health-<node>.json: which health findings the node's agent already put on its timeline (ids,
    the kernel log's offset, the node-risk counts), so a restarted agent adds only new ones."""
    return agent_dir(run_dir) / f"health-{node}.json"


def webhook_token_path(run_dir: PathLike) -> Path:
    return agent_dir(run_dir) / "webhook.token"


def incidents_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / "incidents"


def control_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / "control"


def requests_path(run_dir: PathLike) -> Path:
    return control_dir(run_dir) / "actions.jsonl"


def acked_path(run_dir: PathLike) -> Path:
    return control_dir(run_dir) / "acked.jsonl"


def claims_dir(run_dir: PathLike) -> Path:
    return control_dir(run_dir) / "claims"


def claim_path(run_dir: PathLike, request_id: str) -> Path:
    return claims_dir(run_dir) / request_id


def takeover_claim_path(run_dir: PathLike, request_id: str, generation: int, tag: str) -> Path:
    """A job-level claim's generation >= 1 (agent/claims.py): `tag` is an HMAC only the job's agents compute."""
    return claims_dir(run_dir) / f"{request_id}.takeover-{generation}-{tag}"


def launcher_log(run_dir: PathLike, host: str) -> Path:
    """The node's launcher's own TLS events (a node log: `cordon_ignored`, trainguard/cordon/__init__.py)."""
    return tls_dir(run_dir) / f"node-{host}-launcher.jsonl"


def append_launcher_log(run_dir: PathLike, host: str, line: bytes) -> Path:
    """Append one encoded TLS record to the node's launcher log (one write, opened safely: not a link)."""
    path = launcher_log(run_dir, host)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = safe_read.open_rw_fd(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, "launcher log")
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return path


def recovery_requests_dir(run_dir: PathLike) -> Path:
    """The agent's signed requests that the ranks recover in-process, and the ranks' acknowledgements
    (their content: runtime/resilience/request.py)."""
    return control_dir(run_dir) / "recovery"


def ranks_dir(run_dir: PathLike) -> Path:
    return control_dir(run_dir) / "ranks"


def rank_file(run_dir: PathLike, rank: int) -> Path:
    return ranks_dir(run_dir) / f"rank-{rank}.json"


def cordon_dir(run_dir: PathLike) -> Path:
    return control_dir(run_dir) / "cordon"


def cordon_path(run_dir: PathLike, host: str) -> Path:
    return cordon_dir(run_dir) / host


def launchers_dir(run_dir: PathLike) -> Path:
    return control_dir(run_dir) / "launchers"


def launcher_path(run_dir: PathLike, host: str) -> Path:
    return launchers_dir(run_dir) / f"{host}.json"


def spare_claims_dir(run_dir: PathLike) -> Path:
    """A hot spare's claim of a cordoned node's place, one file per cordon (trainer/spare.py)."""
    return control_dir(run_dir) / "spares"


def spare_adverts_dir(run_dir: PathLike) -> Path:
    """Hot spares waiting to join, one signed advert each (trainguard/spares.py): the eviction verdict counts them."""
    return control_dir(run_dir) / "spares-waiting"


def spare_advert_path(run_dir: PathLike, host: str) -> Path:
    return spare_adverts_dir(run_dir) / f"{host}.json"


def dump_dir(run_dir: PathLike) -> Path:
    return control_dir(run_dir) / "dump"


def faults_fired_path(run_dir: PathLike) -> Path:
    return control_dir(run_dir) / "faults-fired.jsonl"


def stopped_path(run_dir: PathLike) -> Path:
    return control_dir(run_dir) / "stopped.json"


def logs_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / LOGS_DIR


def cost_summary_path(run_dir: PathLike) -> Path:
    return Path(run_dir) / "cost_summary.json"


def run_dir_of(path: PathLike) -> Path:
    """The run directory of `path`, which names either it or its tls/ folder."""
    path = Path(path)
    return path.parent if path.name == "tls" else path


# --------------------------------------------------------------------- RUN/checkpoints/status.json

def read_checkpoint_status(run_dir: PathLike) -> dict | None:
    """The last checkpoint save's outcome (runtime/checkpoint/manager.py `SaveStatus`), or None when there is
    none (or it cannot be read: the writer rewrites it in place, so a reader may meet it half written)."""
    try:
        data = safe_read.read_bytes(checkpoint_status_path(run_dir), safe_read.STATUS_BYTES, "checkpoint status")
        return json.loads(data.strip() or b"null")
    except (OSError, ValueError, RecursionError):
        return None


# --------------------------------------------------------------- RUN/checkpoints/step_<N>/manifest.json

CHECKPOINT_FORMAT_PREFIX = "trainguard-checkpoint/"


def checkpoint_manifest(step_dir: PathLike) -> dict:
    """A step directory's manifest when it parses and carries the fields every manifest has (format, its
    own step, a signature): what `status` and the agent may count as a checkpoint without the key. The
    signature itself is checked by the trainer's verification (runtime/checkpoint/verification.py).
    OSError (FileNotFoundError when missing; safe_read.RunFileError when not a regular file or too large)
    or ValueError naming what is wrong."""
    from trainguard import safe_read

    step_dir = Path(step_dir)
    step_of_name = step_of_dir(step_dir.name)
    manifest = safe_read.read_json(step_dir / CHECKPOINT_MANIFEST, safe_read.MANIFEST_BYTES, "manifest")
    if not isinstance(manifest, dict):
        raise ValueError("not a JSON object")
    if not str(manifest.get("format", "")).startswith(CHECKPOINT_FORMAT_PREFIX):
        raise ValueError(f"format: not a trainguard checkpoint manifest ({str(manifest.get('format'))[:40]!r})")
    step = manifest.get("step")
    if step_of_name is None or type(step) is not int or step != step_of_name:
        raise ValueError(f"step: {str(step)[:40]!r} is not the directory's step")
    signature = manifest.get("signature")
    if not isinstance(signature, dict) or not re.fullmatch(r"[0-9a-f]{64}", str(signature.get("value"))):
        raise ValueError("signature: missing or malformed")
    if not isinstance(manifest.get("files"), dict):
        raise ValueError("files: missing or not an object")
    return manifest


# ----------------------------------------------------------------- RUN/control/actions.jsonl (requests)

REQUEST_PURPOSE = "control-request/1"


def request(action: str, request_id: str, *, alertname: str = "", reason: str = "",
            issued_at: float | None = None) -> dict:
    """One control request, as the agent writes it (signed: `sign_request`) and the trainer reads it."""
    return {"id": request_id, "action": action, "alertname": alertname, "reason": reason,
            "issued_at": time.time() if issued_at is None else issued_at}


def run_name(run_dir: PathLike) -> str:
    """The name a signed request or policy is bound to: the run directory's own name (the same on every node
    that mounts the shared run directory, wherever it is mounted)."""
    return Path(os.path.abspath(run_dir)).name


def sign_request(key: bytes, entry: dict, run_dir: PathLike, *, by: str, key_id: str | None = None) -> dict:
    """`entry` signed with the run's key (trainguard/signed.py, purpose ``control-request/1``), bound to this
    run's name and saying who issued it (``agent:<node>``, ``human:<user>``): only a key holder can make the
    trainer act; a signed request copied from a run of another name is refused."""
    return signed.sign(key, REQUEST_PURPOSE, {**entry, "run": run_name(run_dir), "by": by}, key_id=key_id)


def check_request(key: bytes | None, entry: object, run_dir: PathLike) -> str | None:
    """None when `entry` is a request signed with `key` for this run; else why it is refused
    (trainguard/signed.py's reasons)."""
    return signed.check(key, REQUEST_PURPOSE, entry, {"run": run_name(run_dir)})


def append_request(run_dir: PathLike, entry: dict) -> bool:
    """Append one request unless its id is already there (under an exclusive lock); fsynced.

    False when the id was there (a retry, or a second agent of the job): the trainer never acts twice.
    A write that fails is cut back off (a torn request must not glue onto the next one) and raises an
    OSError naming the file and the bytes it needed.
    """
    path = requests_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with safe_read.open_append(path, what="control log") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            handle.seek(0)
            if any(_id_of(raw) == entry["id"] for raw in safe_read.lines(handle, path)):
                return False
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            line = json.dumps(entry, separators=(",", ":")).encode() + b"\n"
            try:
                handle.write(line)
                handle.flush()
                os.fsync(handle.fileno())
            except OSError as exc:
                cut_back(handle.fileno(), size)
                raise OSError(exc.errno, f"{path}: {exc.strerror or exc} ({len(line)} bytes needed)") from None
            return True
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _id_of(raw: bytes):
    try:
        return json.loads(raw).get("id")
    except (ValueError, AttributeError):
        return None


def cut_back(fd: int, size: int) -> None:
    """Truncate a file back to `size` after a failed append (best effort: readers skip a torn line)."""
    try:
        os.ftruncate(fd, size)
    except OSError:
        pass     # the reader skips a torn line; the request is written again on the retry


class Requests:
    """The reading end of RUN/control/actions.jsonl: the complete lines not read yet, one stat a call."""

    def __init__(self, run_dir: PathLike):
        self.path = requests_path(run_dir)
        self.offset = 0          # bytes already read
        self.lines_read = 0      # complete lines already read

    def new_lines(self) -> list[tuple[int, bytes]]:
        """(line number, raw line) of each complete line appended since the last call."""
        try:
            size = os.stat(self.path).st_size
        except (FileNotFoundError, NotADirectoryError):   # not written yet, or `run_dir` names a file
            return []
        if size <= self.offset:
            return []
        want = min(size - self.offset, safe_read.CONTROL_READ_BYTES)    # a flood is read a bounded piece a call
        try:
            with safe_read.open_file(self.path, what="control log") as handle:
                handle.seek(self.offset)
                chunk = handle.read(want)
        except safe_read.RunFileError:
            return []           # replaced by a FIFO or a device: nothing to read (never a hang)
        complete = chunk[:chunk.rfind(b"\n") + 1]   # a line still being written waits for the next call
        if not complete and len(chunk) == safe_read.CONTROL_READ_BYTES:
            complete = chunk + b"\n"     # a piece of a line past the bound: one malformed line, and on
        self.offset += min(len(complete), len(chunk))
        lines = []
        for raw in complete.splitlines():
            self.lines_read += 1
            lines.append((self.lines_read, raw))
        return lines

    def at(self, lineno: int) -> dict:
        """The request on line `lineno` (1-based)."""
        with safe_read.open_file(self.path, what="control log") as handle:
            for number, raw in enumerate(safe_read.lines(handle, self.path), 1):
                if number == lineno:
                    return json.loads(raw)
        raise LookupError(f"{self.path}:{lineno}: no such line")


def read_requests(run_dir: PathLike, key: bytes | None = None, *, signed_only: bool = False) -> list[dict]:
    """Every readable request of the run (a torn or malformed line is skipped, as the trainer skips it).
    With `signed_only`, only those signed with `key` for this run: the ones the trainer acts on."""
    requests = []
    for _, raw in Requests(run_dir).new_lines():
        try:
            entry = json.loads(raw)
        except ValueError:
            continue
        if not (isinstance(entry, dict) and entry.get("action")):
            continue
        if signed_only and check_request(key, entry, run_dir) is not None:
            continue
        requests.append(entry)
    return requests


# ------------------------------------------------------------------------- RUN/control/acked.jsonl

ACK_PURPOSE = "control-ack/1"


def read_acked(run_dir: PathLike, key: bytes | None = None) -> set[str]:
    """The ids of the requests the trainer already handled: the acknowledgements rank 0 signed with `key` for
    this run (one anyone else appended would keep a genuine request with that id from being acted on; a
    garbage line is skipped, never a crash at start)."""
    try:
        text = safe_read.read_text(acked_path(run_dir), safe_read.LEDGER_BYTES, "control log")
    except FileNotFoundError:
        return set()
    acked = set()
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if signed.check(key, ACK_PURPOSE, entry, {"run": run_name(run_dir)}) is None:
            acked.add(str(entry.get("id")))
    return acked


def append_ack(run_dir: PathLike, request_id: str, action: str, step: int, key: bytes | None = None) -> None:
    """Remember that a request was handled (one O_APPEND write, signed with `key`), so a restarted run does not
    handle it again."""
    entry = {"id": request_id, "action": action, "step": step, "time": time.time(), "run": run_name(run_dir)}
    if key is not None:
        entry = signed.sign(key, ACK_PURPOSE, entry)
    fd = safe_read.open_rw_fd(acked_path(run_dir), os.O_WRONLY | os.O_APPEND | os.O_CREAT, "control log")
    try:
        os.write(fd, (json.dumps(entry) + "\n").encode())
    finally:
        os.close(fd)


# ------------------------------------------------------------------- RUN/control/ranks/rank-<r>.json


def create_whole(path: Path, data: bytes, mode: int) -> bool:
    """Create `path` holding `data`, or return False when it exists; no reader ever sees it empty or half
    written. Written and fsynced under a private name, then linked into place: link() fails where the file
    exists, so of several creators (agents of several nodes on a shared run directory) exactly one wins."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(8).hex()}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.link(temp, path)
        return True
    except FileExistsError:
        return False
    finally:
        temp.unlink(missing_ok=True)

@dataclass(frozen=True)
class RankInfo:
    rank: int
    pid: int
    host: str
    started_at: float
    path: Path
    create_time: float | None = None      # psutil create_time of the rank's process, as it recorded it
    uid: int | None = None
    launcher_pid: int | None = None
    launcher_create_time: float | None = None
    restarts_left: int | None = None      # of its launcher (None: not said)
    boot_time: float | None = None        # the btime those create_times were read against (None: not said)
    # A registration made in another PID namespace (a pod) and matched to this node's processes by the agent
    # (agent/procfs.py `PidNamespaces`): `pid`, `host` and `launcher_pid` are then the node's, these the pod's.
    ns_pid: int | None = None
    ns_host: str | None = None
    ns_candidates: int = 0                # host processes that matched the pod's pid and start time (>1: ambiguous)


def write_rank_file(run_dir: PathLike, rank: int, info: dict) -> Path:
    """Register rank `rank` with `info` (rank, pid, host, started_at, ...; docs/agent.md): an atomic
    replace, so a reader sees the old file or the new one, and the directory's mtime changes."""
    path = rank_file(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".json.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)
    return path


def rank_file_paths(run_dir: PathLike) -> list[Path]:
    return sorted(ranks_dir(run_dir).glob("rank-*.json"))


def read_rank_file(path: PathLike) -> RankInfo:
    """One registration; ValueError, KeyError or TypeError when a field is missing or malformed."""
    return replace(read_registration(str(path)), path=Path(path))


def read_registration(path: str) -> RankInfo:
    """`read_rank_file` with `path` kept as the string it is (`RankFiles` reads every node's files, and a
    Path interns each file name: the interpreter's table of interned strings would grow with the cluster)."""
    data = safe_read.read_json(path, safe_read.CONTROL_BYTES, "rank registration")
    return RankInfo(int(data["rank"]), int(data["pid"]), str(data["host"]), float(data["started_at"]), path,
                    create_time=_optional(data, "create_time", float),
                    uid=_optional(data, "uid", int),
                    launcher_pid=_optional(data, "launcher_pid", int),
                    launcher_create_time=_optional(data, "launcher_create_time", float),
                    restarts_left=_optional(data, "restarts_left", int),
                    boot_time=_optional(data, "boot_time", float))


def _optional(data: dict, key: str, kind: type):
    return None if data.get(key) is None else kind(data[key])


def read_ranks(run_dir: PathLike) -> tuple[list[RankInfo], list[str]]:
    """Every readable rank file, and a message for each unreadable one (file and field named)."""
    found, problems = [], []
    for path in rank_file_paths(run_dir):
        try:
            found.append(read_rank_file(path))
        except FileNotFoundError:
            continue    # replaced between the listing and the read: the launcher is restarting it
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            problems.append(f"{path}: {type(exc).__name__}: {exc}")
    return found, problems


# ----------------------------------------------------- RUN/control/ranks, as an agent follows it

RANK_FILE_NAME = re.compile(r"rank-(\d+)\.json")
MAX_RANK = 1 << 21      # the bitmap of other hosts' ranks is at most 256 KiB; a larger number is a problem


class RankFiles:
    """This host's registrations in RUN/control/ranks, read again only when the directory changes.

    Collectors and the watchdog ask often, and on a shared run directory the folder holds every node's
    ranks (8,000 files at 1,000 nodes). What is kept does not grow with the cluster:

    - this host's `RankInfo`s (`read()`), each with the stat of its file, to see it replaced;
    - of every other host's registration one bit, its rank's (`registered_elsewhere`: the node-file
      selection leaves that rank's log alone): 1 KiB at 1,000 nodes of 8 ranks;
    - the directory's mtime when it was last read. A changed registration is a new inode (an atomic
      replace, runtime/control.py) or a rewrite, and either sets the file's ctime, which no tool can set
      back; so a file whose ctime is older than that mtime (less RACY_SECONDS, for the filesystem's
      timestamp granularity and the writers' clocks) is as it was at the last read, and only the new and
      changed files are read again (the others cost one stat each, not a read and a parse). A directory
      that is itself replaced (another inode) is read whole.

    Two changes within the filesystem's timestamp granularity could share one mtime, so a directory changed
    less than RACY_SECONDS before it was read is read again next time (git's "racily clean" rule).
    `read()` returns the same list object until the files change: read it, do not change it. `generation`
    counts the changes of what this answers (this host's registrations, or another host's set of ranks).
    """

    RACY_SECONDS = 2.0

    def __init__(self, run_dir: PathLike, hosts, adopt=None):
        self.run_dir = Path(run_dir)
        self.hosts = frozenset(hosts)
        # adopt(info) -> RankInfo | None: another host name's registration that is a process of this node
        # after all (a rank in a pod registers its pod's host name and pid; agent/procfs.py PidNamespaces)
        self.adopt = adopt
        self._directory = str(ranks_dir(self.run_dir))
        self._version: tuple[int, int] | None = None    # (inode, mtime_ns) of the directory when read
        self._read_at: tuple[int, int] | None = None    # (inode, mtime_ns) at the last refresh, settled or not
        self._infos: list[RankInfo] = []
        self._ours: dict[str, tuple[tuple, RankInfo]] = {}     # file name -> (its stat, this host's registration)
        self._unreadable: dict[str, tuple[tuple, str]] = {}    # file name -> (its stat, why): not read again
        self._elsewhere = bytearray()                           # bit r: rank r is registered on another host
        self.generation = 0

    @property
    def problems(self) -> list[str]:
        """The unreadable files, as of the last refresh (file and field named)."""
        return [why for _, why in sorted(self._unreadable.values(), key=lambda item: item[1])]

    def read(self) -> list[RankInfo]:
        try:
            st = os.stat(self._directory)
        except OSError:
            if self._read_at is not None:
                self._forget()
            return self._infos
        version = (st.st_ino, st.st_mtime_ns)
        if version != self._version:
            previous = self._read_at
            since = previous[1] - int(self.RACY_SECONDS * 1e9) if previous and previous[0] == st.st_ino else None
            self._refresh(since)
            settled = time.time() - st.st_mtime > self.RACY_SECONDS
            self._version, self._read_at = (version if settled else None), version
        return self._infos

    def known(self) -> list[RankInfo]:
        """What the last `read` found, without looking again (a caller that just read)."""
        return self._infos

    def others_registered(self) -> bool:
        """Some other host registered a rank here (the run directory is shared)."""
        return any(self._elsewhere)

    def registered_elsewhere(self, rank: int) -> bool:
        """Rank `rank` registered on another host (as of the last `read`)."""
        return 0 <= rank and rank >> 3 < len(self._elsewhere) and bool(self._elsewhere[rank >> 3] & (1 << (rank & 7)))

    def _forget(self) -> None:
        self._version = self._read_at = None
        self._ours, self._unreadable, self._infos = {}, {}, []
        self._elsewhere = bytearray()
        self.generation += 1

    def _refresh(self, since: int | None) -> None:
        """List the directory; read the files that are new or changed since `since` (ns; None: all)."""
        ours: dict[str, tuple[tuple, RankInfo]] = {}
        unreadable: dict[str, tuple[tuple, str]] = {}
        elsewhere = bytearray()
        try:
            scan = os.scandir(self._directory)
        except OSError:
            return
        with scan:                  # streamed: the listing itself is never held
            for entry in scan:
                match = RANK_FILE_NAME.fullmatch(entry.name)
                if match is None:
                    continue
                try:
                    st = entry.stat()
                except OSError:
                    continue        # replaced between the listing and the stat: the next change lists it
                mark = (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                name, rank = entry.name, int(match.group(1))
                known = self._ours.get(name) or self._unreadable.get(name)
                if known is not None and known[0] == mark:
                    (ours if isinstance(known[1], RankInfo) else unreadable)[name] = known
                elif known is None and since is not None and st.st_ctime_ns < since and rank < MAX_RANK:
                    _set_bit(elsewhere, rank)     # as it was at the last read: another host's
                else:
                    self._read_one(entry.path, name, rank, mark, ours, unreadable, elsewhere)
        if ours != self._ours or elsewhere != self._elsewhere:
            self.generation += 1
        self._ours, self._unreadable, self._elsewhere = ours, unreadable, elsewhere
        self._infos = sorted((info for _, info in ours.values()), key=lambda info: info.rank)

    def _read_one(self, path: str, name: str, rank: int, mark: tuple, ours: dict, unreadable: dict,
                  elsewhere: bytearray) -> None:
        try:
            info = read_registration(path)
        except FileNotFoundError:
            return          # replaced between the listing and the read: the launcher is restarting it
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            unreadable[name] = (mark, f"{path}: {type(exc).__name__}: {exc}")
            return
        except OSError as exc:
            unreadable[name] = (mark, f"{path}: {exc.strerror or exc}")
            return
        adopted = None if info.host in self.hosts or self.adopt is None else self.adopt(info)
        if info.host in self.hosts or adopted is not None:
            ours[name] = (mark, replace(adopted or info, path=Path(path)))
        elif rank < MAX_RANK:
            _set_bit(elsewhere, rank)
        else:
            unreadable[name] = (mark, f"{path}: rank {rank} is past {MAX_RANK - 1}, the largest followed")


def _set_bit(bits: bytearray, index: int) -> None:
    if index >> 3 >= len(bits):
        bits.extend(bytes((index >> 3) + 1 - len(bits)))
    bits[index >> 3] |= 1 << (index & 7)
