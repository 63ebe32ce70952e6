"""The ranks a distributed checkpoint manager saves and loads with: three collectives, none without need.

On a gloo group of its own: async saves run collectives from a worker thread, and must not share a group
with training's. Without `distributed` (or in a world of one) every call is the identity, and nothing
imports torch.distributed beyond the check.
"""

from __future__ import annotations

from typing import Any


class RankGroup:
    def __init__(self, distributed: bool):
        import torch.distributed as dist

        self.distributed = distributed and dist.is_available() and dist.is_initialized() \
            and dist.get_world_size() > 1
        self.pg = dist.new_group(backend="gloo") if self.distributed else None
        self.rank = dist.get_rank() if self.distributed else 0
        self.size = dist.get_world_size() if self.distributed else 1

    def broadcast(self, value: Any) -> Any:
        """Rank 0's `value`, on every rank."""
        if not self.distributed:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.pg)
        return box[0]

    def agree(self, ok: bool, what: str) -> bool:
        """True when every rank says ok (`what`: which step of a save or load, for a reader of the call)."""
        if not self.distributed:
            return ok
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.pg)
        return bool(flag.item())

    def gather(self, value: Any) -> list:
        """Every rank's `value` on rank 0 (in rank order); an empty list elsewhere."""
        if not self.distributed:
            return [value]
        import torch.distributed as dist

        out = [None] * self.size if self.rank == 0 else None
        dist.gather_object(value, out, dst=0, group=self.pg)
        return out or []
