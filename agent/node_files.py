"""Which of the trainer's rank files on a shared run directory are this node's.

On a cluster the run directory is shared (as the checkpoints are), so RUN/tls/ holds every node's
rank-<r>.jsonl: a thousand nodes of eight ranks are eight thousand files. An agent reads only its own:

1. RUN/control/ranks/rank-<r>.json names the host each rank runs on (the trainer writes it at start,
   runtime/control.py); a rank registered on this host is ours, one registered elsewhere is not.
2. A rank file with no registration (not written yet, or a log from elsewhere) is judged by the `node` of
   its first record; a record that names no node (single-node logs, converted logs) counts as ours, so a
   run on one machine reads everything, as it always did. A file with no complete first line yet is
   nobody's until it has one (asked again each poll).

"This node" is the agent's node name and the machine's host name (the trainer registers the host name;
an operator may name the node otherwise with --node). A rank that moves to another node after an elastic
restart changes hands with its registration; the records it wrote before carry the old node, and the
collector skips those (`is_ours`).

Nothing is kept of the other nodes' files, so memory stays flat as the cluster grows: the follower hands
the listing over one entry at a time (agent/tail.py), a registered rank is decided from RankFiles' bits,
and of the listing only a fingerprint is kept (the count and a sum of the names' and inodes' hashes). A
listing with the same fingerprint and the same registrations selects the same files, so the first
records of unregistered files are read again only when the listing or the registrations change.
"""

from __future__ import annotations

import os
import socket
from typing import Iterable

from trainguard import safe_read, tls
from trainguard.agent.procfs import pid_namespaces
from trainguard.rundir import RankFiles

PEEK_BYTES = 64 << 10      # the first record of a rank file is read this far at most
PEEK_CHUNK = 4 << 10       # ... a block at a time (a first record is a few hundred bytes)
FINGERPRINT_MASK = (1 << 64) - 1
PENDING = object()          # a file with no complete first line yet


class NodeFiles:
    """A `Follower.select`: of the matching entries of RUN/tls, the rank files that belong to this node."""

    def __init__(self, run_dir: str | os.PathLike, node: str, host: str | None = None):
        self.ours = frozenset({node, host or socket.gethostname()})
        # this node's registrations (a pod's too, by PID namespace: agent/procfs.py), a bit for the others'
        self.rank_files = RankFiles(run_dir, self.ours, adopt=pid_namespaces(run_dir, node).adopt)
        self._pod_hosts: frozenset[str] = frozenset()   # host names of this node's pods' ranks: their records'
        self._listed: tuple | None = None      # (count, fingerprint, version) of the listing selected from
        self._selected: dict[str, str] = {}
        self._pending: dict[str, str] = {}     # name -> path: unregistered, no complete first line yet
        self._first_lines = 0                  # pending files that got their first line (a new version)

    def is_ours(self, node) -> bool:
        """A record's `node`: none named, this node's, or one of its pods' (a rank in a pod names its pod)."""
        return node is None or node in self.ours or node in self._pod_hosts

    def version(self) -> tuple[int, int]:
        """Asked by the follower each poll: when it changes, the directory is listed and selected again
        (a rank was registered or moved, or a file nobody registered has its first record now)."""
        infos = self.rank_files.read()
        self._pod_hosts = frozenset(info.ns_host for info in infos if info.ns_host)
        if any(_first_line(path) is not None for path in self._pending.values()):
            self._pending = {}
            self._first_lines += 1
        return self.rank_files.generation, self._first_lines

    def __call__(self, entries: Iterable[os.DirEntry]) -> dict[str, str]:
        here = {info.rank for info in self.rank_files.known()}    # read by `version`, just before
        selected: dict[str, str] = {}
        unregistered: list[tuple[str, str]] = []     # usually none: the trainer registers every rank
        count = fingerprint = 0
        elsewhere = self.rank_files.registered_elsewhere
        for entry in entries:        # a thousand nodes' files: kept to a few operations each
            name = entry.name
            count += 1
            fingerprint += hash(name) ^ entry.inode()
            rank = _rank_of(name)
            if rank in here:
                selected[name] = entry.path
            elif rank is None or not elsewhere(rank):
                unregistered.append((name, entry.path))
        listed = (count, fingerprint & FINGERPRINT_MASK, (self.rank_files.generation, self._first_lines))
        if listed == self._listed:
            return self._selected      # the same files and registrations: the same choice, no file opened
        pending = {}
        for name, path in unregistered:
            node = _node_of_first_record(path)
            if node is PENDING:
                pending[name] = path
            elif self.is_ours(node):
                selected[name] = path
        self._listed, self._selected, self._pending = listed, selected, pending
        return selected


def _rank_of(name: str) -> int | None:
    """3 for rank-3.jsonl, None for a name that is no rank log (no regular expression: this runs for
    every file listed)."""
    digits = name[5:-6]
    if name.startswith("rank-") and name.endswith(".jsonl") and digits.isascii() and digits.isdigit():
        return int(digits)
    return None


def _node_of_first_record(path: str):
    """The `node` of the file's first record (None: it names none), or PENDING."""
    line = _first_line(path)
    if line is None:
        return PENDING
    try:
        node = tls.decode(line, path, 1).get("node")
    except tls.TLSError:
        return None               # the collector reads it and reports the malformed line
    return node if isinstance(node, str) else None


def _first_line(path: str) -> bytes | None:
    """The file's first line, when it is complete (within PEEK_BYTES)."""
    head = b""
    try:
        with safe_read.open_file(path, what="log file") as handle:
            while len(head) < PEEK_BYTES:
                block = handle.read(PEEK_CHUNK)
                end = block.find(b"\n")
                if end >= 0:
                    return head + block[:end]
                if not block:
                    return None
                head += block
    except OSError:
        return None
    return head      # no newline in PEEK_BYTES: judged by what is there (a malformed line: ours, reported)
