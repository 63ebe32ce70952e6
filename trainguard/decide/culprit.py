"""Who stopped the run: the culprit verdict over the evidence of every node, pure.

Called when a stall has been decided (trainguard.decide.stall), before anything is ended, with what
each node gathered at that moment (agent/evidence.py): every rank's Flight Recorder dump and Python
stacks, and each node's own signals. It returns the culprit rank(s) and node, a confidence and the
reasons. The rules, strongest first:

1. **Hardware on the node of a missing rank.** An XID or a lost GPU on a node beats everything when the
   node holds a rank the wavefront leaves behind, or when the wavefront names nobody else.
2. **The collective wavefront**, per process group (Flight Recorder): every member's last enqueued
   ``collective_seq_id``. Ranks behind the group's front never entered the collective the others wait
   in: they are the culprits. Stacks that show them outside any collective raise the confidence.
3. **Stack classes** (py-spy), when the dumps name nobody: ranks waiting in a collective against a rank
   that is elsewhere (sleeping, in the data loader, in a lock): that rank is the culprit.
4. **Silence**: a rank whose dump and stacks are both missing while every other rank waits in the same
   collective did not answer; it is named with a low confidence.
5. Otherwise **no culprit**: every rank is in the same collective (a network or job-wide problem, so the
   usual restore on every node), or the evidence is too thin to say.

No torch, no files: live agents and ``trainguard incidents replay`` run the same function.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable

from trainguard.actions import EVICT, RESTORE

# A frame where a rank waits for a collective (py-spy prints "function (file:line)"): anything inside the
# torch.distributed package (all_reduce, barrier, wait, recv, ...), DDP's own code (its buffer broadcast,
# its join), or autograd's backward, where DDP's reducer waits for its gradient all-reduce (the collective
# is launched from C++, not from Python). Only the innermost frame that does work counts (`stack_class`):
# DDP's forward is on the stack of every rank of a DDP model, whatever that rank is doing inside it.
COLLECTIVE_FRAME = re.compile(r"\((?:\S*/)?torch/distributed/|\((?:\S*/)?torch/nn/parallel/distributed\.py|"
                              r"^\s*(?:\S+\.)?_engine_run_backward \((?:\S*/)?torch/autograd/")
# Frames that only pass the call on or wait on behalf of their caller: the Python standard library
# (threading, queue, selectors, contextlib, runpy: `threading.py:331`, `<frozen runpy>`, .../python3.11/...)
# and nn.Module's call wrappers. The first frame below them (innermost first) says where the rank is.
PLUMBING_FRAME = re.compile(r"\((?:<frozen [^>]*>|(?:\S*/)?python3\.\d+/(?!site-packages/|dist-packages/)\S+|"
                            r"(?:threading|queue|selectors|socket|contextlib|functools|runpy|subprocess|"
                            r"multiprocessing/\S+|concurrent/\S+|asyncio/\S+)\.py|"
                            r"(?:\S*/)?torch/nn/modules/module\.py|(?:\S*/)?torch/utils/hooks\.py):")
# A frame line, "    function (file:line)" (not the local variables `py-spy dump --locals` adds below it).
FRAME_LINE = re.compile(r"^\s+\S.* \(.+:\d+\)\s*$")
# The main thread of a rank, as py-spy names it.
MAIN_THREAD = re.compile(r'^Thread \S+ \([^)]*\): "MainThread"', re.MULTILINE)

IN_COLLECTIVE, ELSEWHERE, UNKNOWN = "collective", "elsewhere", "unknown"

HARDWARE_CONFIDENCE = 0.95
WAVEFRONT_AND_STACKS = 0.9
WAVEFRONT_ONLY = 0.8
STACKS_ONLY = 0.6
SILENT_RANK = 0.4
NO_CULPRIT_SAME_COLLECTIVE = 0.8
NO_CULPRIT_THIN = 0.2


@dataclass(frozen=True)
class RankEvidence:
    """One rank at the moment of the stall: its node, Flight Recorder dump (parsed JSON) and stacks."""
    rank: int
    node: str
    fr: dict[str, Any] | None = None    # torch's _dump_fr_trace_json output, or None when it gave none
    stack: str | None = None        # py-spy dump text, or None


@dataclass(frozen=True)
class NodeSignals:
    """A node's own signals: hardware faults first (XIDs, lost GPUs), NCCL warnings by rank."""
    node: str
    xids: tuple[dict[str, Any], ...] = ()     # ({"gpu": i, "xid": n, ...}, ...)
    gpus_lost: tuple[Any, ...] = ()           # GPU indexes that NVML could not reach
    nccl_warnings: tuple[dict[str, Any], ...] = ()   # ({"rank": r, "line": "..."}, ...)

    @property
    def hardware(self) -> list[str]:
        found = [f"XID {x.get('xid')} on GPU {x.get('gpu')}" for x in self.xids]
        return found + [f"GPU {g} lost" for g in self.gpus_lost]


@dataclass
class CulpritVerdict:
    ranks: list[int] = field(default_factory=list)    # the culprit ranks; empty: no culprit
    node: str | None = None                           # their node, when they share one
    confidence: float = 0.0
    reasons: list[str] = field(default_factory=list)

    @property
    def culprit(self) -> dict[str, Any] | None:
        if not self.ranks and self.node is None:
            return None
        return {"rank": self.ranks[0] if self.ranks else None, "node": self.node, "ranks": list(self.ranks)}


def decide(ranks: list[RankEvidence], nodes: list[NodeSignals]) -> CulpritVerdict:
    """The culprit (or none) from every rank's evidence and every node's signals."""
    node_of = {r.rank: r.node for r in ranks}
    lagging, wave_reasons = wavefront(ranks)
    classes = {r.rank: stack_class(r.stack) for r in ranks}
    stack_reasons = [f"rank {rank} ({node_of[rank]}) stacks: {cls}" for rank, cls in sorted(classes.items())]

    if (verdict := _hardware(nodes, lagging, node_of)) is not None:
        verdict.reasons += wave_reasons
        return verdict
    if lagging:
        elsewhere = [r for r in lagging if classes.get(r) == ELSEWHERE]
        confidence = WAVEFRONT_AND_STACKS if elsewhere else WAVEFRONT_ONLY
        return _named(lagging, node_of, confidence, wave_reasons + stack_reasons)
    waiting = [r for r, cls in classes.items() if cls == IN_COLLECTIVE]
    elsewhere = sorted(r for r, cls in classes.items() if cls == ELSEWHERE)
    if waiting and elsewhere:
        reasons = [f"ranks {_list(sorted(waiting))} wait in a collective; rank(s) {_list(elsewhere)} "
                   "are elsewhere"]
        return _named(elsewhere, node_of, STACKS_ONLY, reasons + wave_reasons + stack_reasons)
    silent = sorted(r.rank for r in ranks if r.fr is None and r.stack is None)
    if silent and waiting and len(waiting) + len(silent) == len(ranks):
        reasons = [f"rank(s) {_list(silent)} answered neither the Flight Recorder request nor py-spy "
                   "while every other rank waits in a collective"]
        return _named(silent, node_of, SILENT_RANK, reasons + wave_reasons + stack_reasons)
    if ranks and len(waiting) == len(ranks):
        return CulpritVerdict([], None, NO_CULPRIT_SAME_COLLECTIVE,
                       ["no culprit: all ranks in the same collective (a network or job-wide problem)"]
                       + wave_reasons + stack_reasons)
    return CulpritVerdict([], None, NO_CULPRIT_THIN, ["no culprit: the evidence names no rank"]
                   + wave_reasons + stack_reasons)


def wavefront(ranks: list[RankEvidence]) -> tuple[list[int], list[str]]:
    """(ranks behind their process group's front, reasons), from the Flight Recorder dumps.

    A rank's position in a group is its last enqueued ``collective_seq_id`` there; a rank whose dump does
    not show the group at all is left out (no evidence), never counted behind.
    """
    groups: dict[str, dict[int, int]] = {}
    for evidence in ranks:
        for group, seq in enqueued(evidence.fr).items():
            groups.setdefault(group, {})[evidence.rank] = seq
    lagging: set[int] = set()
    reasons = []
    for group, seqs in sorted(groups.items()):
        front = max(seqs.values())
        behind = sorted(r for r, seq in seqs.items() if seq < front)
        at_front = sorted(r for r, seq in seqs.items() if seq == front)
        if behind:
            lagging.update(behind)
            detail = ", ".join(f"rank {r} at #{seqs[r]}" for r in behind)
            reasons.append(f"process group {group}: {detail} while ranks {_list(at_front)} entered "
                           f"collective #{front}: behind the wavefront")
        else:
            reasons.append(f"process group {group}: ranks {_list(at_front)} all at collective #{front}")
    return sorted(lagging), reasons


def enqueued(fr: dict[str, Any] | None) -> dict[str, int]:
    """Process group -> last enqueued collective sequence number, from one Flight Recorder dump."""
    if not isinstance(fr, dict):
        return {}
    found: dict[str, int] = {}
    status = fr.get("pg_status")
    if isinstance(status, dict):
        for group, fields in status.items():
            try:
                found[str(group)] = int(fields["last_enqueued_collective"])
            except (TypeError, KeyError, ValueError):
                continue
    for entry in fr.get("entries") or ():      # older dumps without pg_status: the entries themselves
        if not isinstance(entry, dict) or entry.get("is_p2p"):
            continue
        try:
            group, seq = str(entry["pg_id"]), int(entry["collective_seq_id"])
        except (TypeError, KeyError, ValueError):
            continue
        found[group] = max(found.get(group, seq), seq)
    return found


def stack_class(stack: str | None) -> str:
    """Whether a rank's main thread waits in a collective, is elsewhere, or is unknown (no stacks).

    Decided by the innermost frame that is not plumbing (py-spy prints the innermost first): a rank
    sleeping in its own forward hook of a DDP model has DDP's forward further down its stack, but it waits
    in the hook, not in a collective.
    """
    if not stack or not stack.strip():
        return UNKNOWN
    main = MAIN_THREAD.search(stack) or re.search(r"^Thread .*$", stack, re.MULTILINE)
    body = stack[main.end():] if main else stack
    following = re.search(r"^(?:Thread |Process )", body, re.MULTILINE)
    frames = [line for line in (body[:following.start()] if following else body).splitlines()
              if FRAME_LINE.match(line)]
    if not frames:
        return UNKNOWN
    innermost = next((f for f in frames if not PLUMBING_FRAME.search(f)), frames[0])
    return IN_COLLECTIVE if COLLECTIVE_FRAME.search(innermost) else ELSEWHERE


def _hardware(nodes: list[NodeSignals], lagging: list[int], node_of: dict[int, str]) -> CulpritVerdict | None:
    faulty = [n for n in nodes if n.hardware]
    if not faulty:
        return None
    lagging_nodes = {node_of[r] for r in lagging if r in node_of}
    suspects = [n for n in faulty if n.node in lagging_nodes] or ([] if lagging_nodes else faulty)
    if not suspects:
        return None          # hardware trouble elsewhere, but the wavefront names another node
    chosen = sorted(suspects, key=lambda n: n.node)[0]
    ranks = sorted(r for r, host in node_of.items() if host == chosen.node and (r in lagging or not lagging))
    reasons = [f"node {chosen.node}: {', '.join(chosen.hardware)}: a hardware fault beats everything"]
    reasons += [f"node {n.node} also reports {', '.join(n.hardware)}" for n in suspects if n is not chosen]
    return CulpritVerdict(ranks, chosen.node, HARDWARE_CONFIDENCE, reasons)


def _named(culprits: list[int], node_of: dict[int, str], confidence: float, reasons: list[str]) -> CulpritVerdict:
    nodes = sorted({str(node_of.get(r)) for r in culprits})
    node = nodes[0] if len(nodes) == 1 else None
    if node is None:
        reasons = reasons + [f"the culprit ranks span several nodes ({_list(nodes)}): no single node to keep out"]
    return CulpritVerdict(sorted(culprits), node, confidence, reasons)


def _list(items: Iterable[object]) -> str:
    return ", ".join(str(i) for i in items)


# ------------------------------------------------------------------------------------------ eviction

@dataclass(frozen=True)
class Job:
    """What eviction must respect: the job's nodes now, its elastic bounds, recent evictions, and the hot
    spares waiting to take a kept-out node's place (signed and fresh adverts, trainguard/spares.py)."""
    nodes: tuple[str, ...]          # nodes in the job (not cordoned)
    min_nodes: int = 1
    max_nodes: int = 1
    evictions_last_hour: int = 0
    spares: int = 0                 # hot spares waiting that a new vacancy would get


def eviction(verdict: CulpritVerdict, job: Job, evict: str, max_per_hour: int) -> tuple[str, str]:
    """(``evict`` | ``restore``, why): keep the culprit's node out, or the usual restore in place.

    `evict` is the policy's ``restore.evict``: ``auto`` (only when the job is elastic, or a hot spare waits
    to keep it whole), ``on``, ``off``. Never without a culprit node, never below ``min_nodes`` counting
    the waiting spares (one takes the kept-out node's place), never more than `max_per_hour`.
    """
    if evict == "off":
        return RESTORE, "restore.evict is off"
    if evict == "auto" and job.min_nodes >= job.max_nodes and job.spares < 1:
        return RESTORE, f"the job is not elastic (--nnodes {job.min_nodes}:{job.max_nodes}) and no hot spare waits"
    if verdict.node is None:
        return RESTORE, "no culprit node to keep out"
    if verdict.node not in job.nodes:
        return RESTORE, f"the culprit's node {verdict.node} is not in the job"
    remaining = len(job.nodes) - 1
    if remaining + job.spares < max(1, job.min_nodes):
        return RESTORE, (f"evicting {verdict.node} would leave {remaining} node(s) and {job.spares} hot spare(s), "
                         f"below the minimum {job.min_nodes}")
    if job.evictions_last_hour >= max_per_hour:
        return RESTORE, f"{job.evictions_last_hour} eviction(s) in the last hour: the limit is {max_per_hour}"
    if job.spares:
        return EVICT, (f"keep {verdict.node} out; a hot spare takes its place ({job.spares} waiting): the job "
                       f"re-forms on {remaining + 1} node(s)")
    return EVICT, f"keep {verdict.node} out; the job re-forms on {remaining} node(s)"
