"""A Protector on `cpu:0` (a Transformers Trainer's `args.device` under torchrun) resumes: torch.load knows
no `cpu:N` location, so every restart of such a run used to die before its first step."""

from __future__ import annotations

import torch

from examples.plain_loop import TokenStream, train_step
from trainguard.protect import Protector, RNGState
from trainguard.runtime.checkpoint.verification import load_location


def run(run_dir, steps: int, device: str) -> int | None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 8), torch.nn.Linear(8, 64))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    data = TokenStream()
    protector = Protector(run_dir, states={"model": model, "optim": optimizer, "data": data, "rng": RNGState()},
                          device=device,
                          checkpoint_every=2)
    begun = protector.begin(integration="plain")
    while protector.state.step < steps:
        train_step(protector, model, optimizer, scheduler, data, {})
    protector.finish()
    protector.close()
    return begun.resumed_from


def test_a_run_on_an_indexed_cpu_device_resumes_from_its_checkpoint(tmp_path):
    assert run(tmp_path / "run", 2, "cpu:0") is None
    assert run(tmp_path / "run", 4, "cpu:0") == 2


def test_the_load_location_of_a_cpu_device_is_plain_cpu():
    assert load_location("cpu:0") == "cpu" and load_location(torch.device("cpu", 1)) == "cpu"
    assert load_location("cpu") == "cpu" and load_location(None) is None
    assert load_location("meta") == "meta" and load_location({"cuda:1": "cuda:0"}) == {"cuda:1": "cuda:0"}
