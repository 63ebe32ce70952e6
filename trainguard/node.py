"""This node's name: the host name, or ``TRAINGUARD_NODE`` when set.

Rank files (``host``), the agent's executor and the launcher's cordon check all name a node the same
way. Setting ``TRAINGUARD_NODE`` gives one machine several node identities (simulated nodes in tests
and drills), or names a node as the scheduler does when its host name says nothing.
"""

from __future__ import annotations

import os
import socket

ENV = "TRAINGUARD_NODE"


def node_name() -> str:
    return os.environ.get(ENV) or socket.gethostname()
