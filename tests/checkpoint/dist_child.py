"""The ranks of the sharded-checkpoint test (started once by torchrun from test_checkpoint_sharded).

    torchrun --nproc-per-node 2 dist_child.py BASE_DIR KEY_FILE

In one launch, for FSDP2 (sync save) and DDP (async save), each in BASE_DIR/<mode>: a GPT trains two steps,
every rank saves step_2 through the distributed manager, rank 0 writes the whole weights and Adam moments
to expected.pt, then a fresh model restores it in place (resharded into 2 ranks) and is compared with
them; each rank prints the files it hashed (only those its load reads). Then the gradient norms
(trainer/step.GradNorms) of an FSDP2 and a DDP model on the same seed and batch are compared.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from trainguard.trainer import parallel
from trainguard.runtime.checkpoint import CheckpointManager, verification
from trainguard.trainer.config import ModelConfig
from trainguard.trainer.model import GPT
from trainguard.trainer.step import GradNorms

CONFIG = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)


def build(mode: str) -> tuple[GPT, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    wrapped = parallel.wrap(model, mode, dist.get_world_size(), torch.device("cpu"))
    return model, wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-2)


def batches(steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + dist.get_rank())
    return [torch.randint(0, 64, (2, 16), generator=generator) for _ in range(steps)]


def train(model: torch.nn.Module, optim: torch.optim.Optimizer, steps: int = 2) -> None:
    for idx in batches(steps):
        _, loss = model(idx, idx)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, on every rank (a collective under FSDP2): to compare models across layouts."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    inner = getattr(model, "module", model) if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    return get_model_state_dict(inner, options=StateDictOptions(full_state_dict=True))


def moments(model, optim) -> dict:
    """exp_avg of every parameter, whole (the optimizer state a reshard must get right too)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    state = get_optimizer_state_dict(parallel._unwrapped(model), optim,
                                     options=StateDictOptions(full_state_dict=True))
    return {name: s["exp_avg"] for name, s in sorted(state["state"].items())}


def hashed_files() -> list[str]:
    """Names of the files `verification` hashes from here on (appended as they are)."""
    seen: list[str] = []
    real = verification._hash_checked

    def recording(path, entry, keep):
        seen.append(path.name)
        return real(path, entry, keep)

    verification._hash_checked = recording
    return seen


def save_and_restore(run_dir: Path, key_file: str, mode: str, async_save: bool) -> None:
    _, model, optim = build(mode)
    manager = CheckpointManager(run_dir, key_file=key_file, distributed=True, async_save=async_save,
                                world_size=dist.get_world_size())
    train(model, optim)
    manager.save(2, {**parallel.train_state(model, optim), "data": {"position": [dist.get_rank()]}}, stable=True)
    manager.wait()
    weights, exp_avg = full_weights(model), moments(model, optim)
    if dist.get_rank() == 0:
        torch.save({"weights": weights, "exp_avg": exp_avg}, run_dir / "expected.pt")
    dist.barrier()

    _, model, optim = build(mode)   # a fresh model restores it, resharded into this world
    seen = hashed_files()
    ckpt, state = manager.load_latest(into=parallel.train_state(model, optim))
    parallel.load_train_state(model, optim, state)
    for name, tensor in weights.items():
        assert torch.equal(full_weights(model)[name], tensor), f"{mode}: {name} differs after restore"
    for name, tensor in moments(model, optim).items():
        assert torch.equal(exp_avg[name], tensor), f"{mode}: exp_avg of {name} differs after restore"
    assert state["data"] == {"position": [0]}
    train(model, optim, steps=1)   # and training goes on from it
    manager.close()
    print(f"RESTORED {mode} step={ckpt.step} rank={dist.get_rank()} hashed={json.dumps(sorted(set(seen)))}",
          flush=True)


def norms(mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """GradNorms after one backward on this rank's batch, whole-model values on every rank."""
    model, wrapped, _ = build(mode)
    (idx,) = batches(1)
    _, loss = wrapped(idx, idx)
    loss.backward()
    names, owners = model.layer_of_parameters()
    return GradNorms(list(model.parameters()), owners, names).compute()


def main() -> None:
    base, key_file = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    for mode, async_save in ((parallel.FSDP2, False), (parallel.DDP, True)):
        save_and_restore(base / mode, key_file, mode, async_save)
    (fsdp_total, fsdp_layers), (ddp_total, ddp_layers) = norms(parallel.FSDP2), norms(parallel.DDP)
    torch.testing.assert_close(fsdp_total, ddp_total, rtol=1e-5, atol=0)
    torch.testing.assert_close(fsdp_layers, ddp_layers, rtol=1e-5, atol=0)
    print(f"NORMS OK {fsdp_total.item():.6f} {ddp_total.item():.6f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
