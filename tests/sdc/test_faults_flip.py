"""bitflip and gradflip (trainer/faults.py): one bit of one element of one parameter, on one rank, once."""

from __future__ import annotations

import torch

from trainguard.trainer import fingerprint as fp
from trainguard.trainer.faults import Fault, FaultInjector, parse


def model_params():
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    layer(torch.randn(2, 4)).sum().backward()
    return list(layer.parameters()), ["weight", "bias"]


def test_parse_aims_the_flips_at_rank_0_unless_told():
    assert parse("bitflip@7") == Fault("bitflip", 7, 0)
    assert parse("gradflip@10:1") == Fault("gradflip", 10, 1)


def test_one_bit_of_the_largest_element_flips_once_and_is_logged(tmp_path):
    params, names = model_params()
    emitted = []
    faults = FaultInjector(["bitflip@5", "gradflip@5"], tmp_path, rank=0, emit=lambda *a, **k: emitted.append((a, k)))
    weights = [p.detach().clone() for p in params]
    grads = [p.grad.clone() for p in params]
    faults.bit_flip(4, params, names)                     # not yet
    assert all(torch.equal(a, b) for a, b in zip(weights, params))
    faults.bit_flip(5, params, names)
    faults.grad_flip(5, params, names)
    (kind, weight_event), (_, grad_event) = [(a[0], k) for a, k in emitted]
    assert kind == "fault_injected" and weight_event["param"] == "bias" and weight_event["target"] == "weight"
    assert grad_event["target"] == "gradient" and grad_event["bit"] == 21
    changed = (fp.as_bits(params[1]) ^ fp.as_bits(weights[1])).tolist()
    assert sorted(changed) == [0, 0, 1 << 21]              # one bit of one element
    assert torch.equal(params[0], weights[0]) and torch.equal(params[0].grad, grads[0])
    assert (fp.as_bits(params[1].grad) ^ fp.as_bits(grads[1])).count_nonzero() == 1
    assert abs(weight_event["after"]) != abs(weight_event["before"])
    again = FaultInjector(["bitflip@5"], tmp_path, rank=0, emit=lambda *a, **k: None)
    assert again.pending == []                              # fired once, across restarts too
