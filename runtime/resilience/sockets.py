"""Release a gloo collective that is blocked on a failed peer: shut its TCP connections down.

gloo has no abort that wakes an operation in flight (``ProcessGroupGloo.abort`` marks the group; a rank
blocked in a receive keeps waiting until its timeout, 30 minutes here), and its connections close only
when the process exits. Shutting a connection down (``shutdown(SHUT_RDWR)``, not ``close``: the descriptor
stays gloo's) makes every read and write on it fail at once, on this side and on the peer's: a blocked
collective here raises, and so does the peer's, which is how the failure spreads to every rank in
milliseconds. Listening sockets are left alone (gloo's accept loop treats an error there as fatal).

Which connections: the established TCP connections this process opened while the group was formed
(`inodes()` before and after), less any to or from the job store's port. Linux only (/proc); elsewhere
nothing is shut down and a blocked rank waits for its timeout, as before (docs/recovery.md).
"""

from __future__ import annotations

import os
import socket

ESTABLISHED = "01"


def established() -> dict[int, tuple[int, int]]:
    """inode -> (local port, remote port) of the established TCP connections in this network namespace."""
    found: dict[int, tuple[int, int]] = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as handle:
                rows = handle.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            parts = row.split()
            if len(parts) < 10 or parts[3] != ESTABLISHED:
                continue
            local, remote = parts[1].rsplit(":", 1)[1], parts[2].rsplit(":", 1)[1]
            found[int(parts[9])] = (int(local, 16), int(remote, 16))
    return found


def inodes() -> dict[int, int]:
    """inode -> descriptor of every socket this process holds."""
    found = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return {}
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:[") and target.endswith("]"):
            found[int(target[8:-1])] = int(name)
    return found


def shut_down(formed: set[int], keep_ports: set[int]) -> int:
    """Shut down this process's established connections among `formed` (socket inodes), except those to or
    from `keep_ports`; how many."""
    connections = established()
    count = 0
    for inode, fd in inodes().items():
        ports = connections.get(inode)
        if inode not in formed or ports is None or keep_ports & set(ports):
            continue
        try:
            duplicate = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue            # closed since it was listed
        try:
            duplicate.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:
            pass
        finally:
            duplicate.close()   # the duplicate only: the descriptor stays gloo's
    return count
