"""Helpers of the checkpoint tests: a real training state and a deep comparison."""

from __future__ import annotations

import random

import torch

from trainguard.trainer.config import ModelConfig
from trainguard.trainer.model import GPT


def training_state(seed: int = 0, steps: int = 2, n_embd: int = 32) -> tuple[dict, GPT, torch.optim.Optimizer]:
    """The state a training loop checkpoints: a GPT (tied weights) after a few AdamW steps, its LR
    scheduler, a data position and the RNG states."""
    torch.manual_seed(seed)
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=n_embd, block_size=16, vocab_size=64))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: min(1.0, (step + 1) / 10))
    for _ in range(steps):
        idx = torch.randint(0, 64, (2, 16))
        _, loss = model(idx, idx)
        loss.backward()
        optim.step()
        sched.step()
        optim.zero_grad(set_to_none=True)
    state = {
        "model": model.state_dict(),
        "optim": optim.state_dict(),
        "sched": sched.state_dict(),
        "data": {"epoch": 0, "position": [1234, 5678], "skipped_windows": []},
        "rng": {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])},
    }
    return state, model, optim


def big_state(megabytes: int, seed: int = 1) -> dict:
    torch.manual_seed(seed)
    return {"model": {f"w{i}": torch.randn(256 * 1024) for i in range(megabytes)}}


def assert_same(a, b, where: str = "state") -> None:
    assert type(a) is type(b) or isinstance(a, dict) and isinstance(b, dict), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"{where}: tensors differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
