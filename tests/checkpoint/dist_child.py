"""One rank of the sharded-checkpoint tests (started by torchrun from test_checkpoint_sharded).

    torchrun --nproc-per-node K dist_child.py save|load RUN_DIR KEY_FILE MODE [ASYNC]

save: a GPT wrapped by MODE (ddp | fsdp2) trains two steps on K ranks and every rank saves step_2
      through the manager (distributed); rank 0 also writes the whole weights to RUN_DIR/expected.pt;
      then a fresh model restores it, as `load` does (one launch fewer).
load: a fresh GPT wrapped by MODE on K ranks restores the newest checkpoint in place (resharded to K)
      and compares its whole weights and optimizer moments with what was saved; prints RESTORED OK.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from trainguard.trainer import parallel
from trainguard.trainer.checkpoint import CheckpointManager
from trainguard.trainer.config import ModelConfig
from trainguard.trainer.model import GPT


def build(mode: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    wrapped = parallel.wrap(model, mode, dist.get_world_size(), torch.device("cpu"))
    return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-2)


def train(model: torch.nn.Module, optim: torch.optim.Optimizer, steps: int = 2) -> None:
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(steps):
        idx = torch.randint(0, 64, (2, 16), generator=generator)
        _, loss = model(idx, idx)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)


def moments(model, optim) -> dict:
    """exp_avg of every parameter, whole (the optimizer state a reshard must get right too)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(parallel._unwrapped(model), optim,
                                     options=StateDictOptions(full_state_dict=True))
    return {name: s["exp_avg"] for name, s in sorted(state["state"].items())}


def restore(manager: CheckpointManager, model, optim, run_dir: Path) -> None:
    target = parallel.train_state(model, optim)
    found = manager.load_latest(into=target)
    assert found is not None, "nothing restored"
    ckpt, state = found
    parallel.load_train_state(model, optim, state)
    expected = torch.load(run_dir / "expected.pt", weights_only=True)
    weights, exp_avg = parallel.full_weights(model), moments(model, optim)
    for name, tensor in expected["weights"].items():
        assert torch.equal(weights[name], tensor), f"{name} differs after restore"
    for name, tensor in expected["exp_avg"].items():
        assert torch.equal(exp_avg[name], tensor), f"exp_avg of {name} differs after restore"
    assert state["data"] == {"position": [0]}
    train(model, optim, steps=1)   # and training goes on from it
    print(f"RESTORED OK step={ckpt.step} world={dist.get_world_size()}", flush=True)


def main() -> None:
    action, run_dir, key_file, mode = sys.argv[1:5]
    async_save = len(sys.argv) > 5 and sys.argv[5] == "async"
    dist.init_process_group("gloo")
    model, optim = build(mode)
    manager = CheckpointManager(run_dir, key_file=key_file, distributed=True, async_save=async_save,
                                world_size=dist.get_world_size())
    if action == "save":
        train(model, optim)
        state = {**parallel.train_state(model, optim), "data": {"position": [dist.get_rank()]}}
        manager.save(2, state, stable=True)
        manager.wait()
        weights, exp_avg = parallel.full_weights(model), moments(model, optim)
        if dist.get_rank() == 0:
            torch.save({"weights": weights, "exp_avg": exp_avg}, Path(run_dir) / "expected.pt")
        dist.barrier()
        print("SAVED OK", flush=True)
        model, optim = build(mode)
    restore(manager, model, optim, Path(run_dir))
    manager.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
