"""Verified checkpoints across ranks, in one of two layouts.

- Whole (the default: DDP, one process, a Trainer): rank 0 saves the whole state; to load, rank 0 picks
  the checkpoint (the newest verified, or the newest *stable* verified for a rollback) and broadcasts its
  choice, so ranks never disagree because one of them looked at the directory a moment later, and every
  rank loads exactly that one.
- `distributed` (FSDP2: each rank holds shards): every rank saves its own shards through
  torch.distributed.checkpoint, rank 0 signs the manifest once all are durable; to load, every rank calls
  together, rank 0 names each candidate, every rank verifies the files its own load reads, and all agree
  before DCP loads them into the rank's current state (`target`), resharded to its layout.

The files, hashes and signature are `trainguard.runtime.checkpoint.CheckpointManager`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from trainguard.runtime.checkpoint import Checkpoint, CheckpointManager


class RankCheckpoints:
    def __init__(self, run_dir: Path, *, rank: int, world_size: int, on_event: Callable[..., Any],
                 key_file: str = "", keep_last: int = 3, async_save: bool = False, on_error: str = "warn",
                 distributed: bool = False, compress: str = "none"):
        self.rank, self.world = rank, world_size
        self.distributed = distributed
        self.manager = CheckpointManager(run_dir, key_file=key_file or None, keep_last=keep_last,
                                         async_save=async_save, on_error=on_error, on_event=on_event,
                                         world_size=world_size, distributed=distributed, compress=compress)

    @property
    def saves_here(self) -> bool:
        """Whether this rank calls `save` (every rank when distributed, else rank 0)."""
        return self.distributed or self.rank == 0

    def save(self, step: int, state: dict, stable: bool, meta: dict | None = None) -> Path | None:
        """On the ranks that save (`saves_here`). The directory the checkpoint has (or will have, once
        durable); None if the save failed and the manager was told to warn rather than raise (it has
        logged and emitted why)."""
        handle = self.manager.save(step, state, stable=stable, meta=meta)
        return None if handle.error is not None else handle.path

    def wait(self) -> None:
        if self.saves_here:
            self.manager.wait()

    def restore(self, stable_only: bool, device: torch.device,
                target: Callable[[], dict] | None = None) -> tuple[Checkpoint, dict] | None:
        """(checkpoint, state) of the newest verified (stable) checkpoint, the same one on every rank.

        Whole: rank 0 verifies and loads (the store reports each checkpoint it refuses, with the reason),
        then broadcasts its choice; the other ranks load exactly that one, hash-checked again as they read.
        Distributed: every rank loads its shards in place into `target()` (built only once a candidate is
        there), after all ranks verified what they read.
        """
        if self.distributed:
            self.manager.wait()
            return self.manager.load_latest(stable_only=stable_only, map_location=device, into=target)
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
        """After a rollback to `step`, newer checkpoints belong to an abandoned timeline (rank 0 moves them;
        distributed, every rank first finishes its part of a save in flight)."""
        if self.saves_here:
            self.manager.supersede_after(step)

    def close(self) -> None:
        if self.saves_here:
            self.manager.close()
