"""Pure decision logic: records in, decisions out. No torch, files, sockets or clocks here.

The trainer, the agent and `trainguard replay` call these very objects, so a recorded incident replays
exactly as the live run decided it.
"""

from trainguard.decide.decision import Decision

__all__ = ["Decision"]
