"""Which of the trainer's rank files on a shared run directory are this node's.

On a cluster the run directory is shared (as the checkpoints are), so RUN/tls/ holds every node's
rank-<r>.jsonl: a thousand nodes of eight ranks are eight thousand files. An agent reads only its own:

1. RUN/control/ranks/rank-<r>.json names the host each rank runs on (the trainer writes it at start,
   trainer/control.py); a rank registered on this host is ours, one registered elsewhere is not.
2. A rank file with no registration (not written yet, or a log from elsewhere) is judged by the `node` of
   its first record; a record that names no node (single-node logs, converted logs) counts as ours, so a
   run on one machine reads everything, as it always did.

"This node" is the agent's node name and the machine's host name (the trainer registers the host name;
an operator may name the node otherwise with --node). The verdicts are cached: the selection is made
again only when the listing or the registrations change, so a poll costs the same at 1 and 1,000 nodes.
A rank that moves to another node after an elastic restart changes hands with its registration; the
records it wrote before carry the old node, and the collector skips those (`is_ours`).
"""

from __future__ import annotations

import os
import re
import socket

from trainguard.agent.restore import RankFiles

from trainguard import tls

RANK_LOG = re.compile(r"^rank-(\d+)\.jsonl$")
PEEK_BYTES = 64 << 10      # the first record of a rank file is read this far at most


class NodeFiles:
    """A `Follower.select`: the listing's rank files that belong to this node."""

    def __init__(self, run_dir: str | os.PathLike, node: str, host: str | None = None):
        self.ours = frozenset({node, host or socket.gethostname()})
        self.rank_files = RankFiles(run_dir, self.ours)    # keeps only this node's registrations
        self._seen: tuple | None = None   # the (listing, registrations) objects selected from (held: no id reuse)
        self._selected: dict[str, str] = {}
        self._first_node: dict[tuple[str, int], str | None] = {}   # (name, inode) -> node of its first record
        self._undecided = False   # a file with no complete first line yet: decide again next poll

    def is_ours(self, node) -> bool:
        """A record's `node`: none named, or this node's."""
        return node is None or node in self.ours

    def __call__(self, listing: dict[str, str]) -> dict[str, str]:
        registered = self.rank_files.read()        # the same list object until RUN/control/ranks changes
        seen = self._seen
        if seen is None or seen[0] is not listing or seen[1] is not registered or self._undecided:
            here = {info.rank for info in registered}
            self._undecided = False
            self._selected = {name: path for name, path in listing.items() if self._owned(name, path, here)}
            self._seen = (listing, registered)
        return self._selected

    def _owned(self, name: str, path: str, here: set[int]) -> bool:
        match = RANK_LOG.match(name)
        if match and int(match.group(1)) in here:
            return True
        if match and self.rank_files.registered_elsewhere(int(match.group(1))):
            return False
        return self.is_ours(self._node_of_first_record(name, path))

    def _node_of_first_record(self, name: str, path: str) -> str | None:
        try:
            inode = os.stat(path).st_ino
        except OSError:
            return None
        key = (name, inode)
        if key not in self._first_node:
            line = _first_line(path)
            if line is None:              # empty so far: ours for now (nothing to read), asked again
                self._undecided = True
                return None
            try:
                node = tls.decode(line, path, 1).get("node")
            except tls.TLSError:
                node = None               # the collector reads it and reports the malformed line
            self._first_node[key] = node if isinstance(node, str) else None
        return self._first_node[key]


def _first_line(path: str) -> bytes | None:
    try:
        with open(path, "rb") as handle:
            head = handle.read(PEEK_BYTES)
    except OSError:
        return None
    end = head.find(b"\n")
    return head[:end] if end >= 0 else None
