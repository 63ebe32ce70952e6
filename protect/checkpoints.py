"""Verified checkpoints across ranks: rank 0 saves; to load, rank 0 picks and every rank loads its choice.

Rank 0 picks the checkpoint (the newest verified, or the newest *stable* verified for a rollback) and
broadcasts its choice, so ranks never disagree because one of them looked at the directory a moment
later than another. The files, hashes and signature are `trainguard.trainer.checkpoint.CheckpointManager`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from trainguard.trainer.checkpoint import Checkpoint, CheckpointManager


class RankCheckpoints:
    def __init__(self, run_dir: Path, *, rank: int, world_size: int, on_event: Callable[..., Any],
                 key_file: str = "", keep_last: int = 3, async_save: bool = False, on_error: str = "warn"):
        self.rank, self.world = rank, world_size
        self.manager = CheckpointManager(run_dir, key_file=key_file or None, keep_last=keep_last,
                                         async_save=async_save, on_error=on_error, on_event=on_event,
                                         world_size=world_size)

    def save(self, step: int, state: dict, stable: bool, meta: dict | None = None) -> Path | None:
        """Rank 0 only. The directory the checkpoint has (or will have, once durable); None if the save
        failed and the manager was told to warn rather than raise (it has logged and emitted why)."""
        handle = self.manager.save(step, state, stable=stable, meta=meta)
        return None if handle.error is not None else handle.path

    def wait(self) -> None:
        if self.rank == 0:
            self.manager.wait()

    def restore(self, stable_only: bool, device: torch.device) -> tuple[Checkpoint, dict] | None:
        """(checkpoint, state) of the newest verified (stable) checkpoint, the same one on every rank.

        Rank 0 verifies and loads (the store reports each checkpoint it refuses, with the reason), then
        broadcasts its choice; the other ranks load exactly that one, hash-checked again as they read.
        """
        found = None
        if self.rank == 0:
            self.manager.wait()   # a save still in flight must be durable before it can be chosen
            found = self.manager.load_latest(stable_only=stable_only, map_location=device)
        if self.world == 1:
            return found
        choice = [found[0] if found else None]
        dist.broadcast_object_list(choice, src=0)
        if choice[0] is None:
            return None
        return found if self.rank == 0 else (choice[0], self.manager.load(choice[0], map_location=device))

    def verified_step(self) -> int | None:
        """Step of the newest checkpoint whose signature and hashes verify (rank 0; reads, loads nothing)."""
        self.manager.wait()
        found = self.manager.latest_verified()
        return found.step if found else None

    def abandon_after(self, step: int) -> None:
        """After a rollback to `step`, newer checkpoints belong to an abandoned timeline (rank 0)."""
        if self.rank == 0:
            self.manager.supersede_after(step)

    def close(self) -> None:
        if self.rank == 0:
            self.manager.close()
