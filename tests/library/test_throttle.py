"""cost_throttle cuts the micro-batch the loop keeps in TrainState (or hands it to `cut_micro_batch`); a
loop that has neither (the Transformers and Lightning Trainers) is told so in the event, and no change that
did not happen is logged."""

from __future__ import annotations

import torch

from tests.trainer.helpers import events
from trainguard.actions import COST_THROTTLE
from trainguard.protect import Callbacks, Protector, handlers

IDS = {"id": "r1", "alertname": "CostBudgetThrottle", "reason": ""}
THROTTLE = handlers.Order(COST_THROTTLE, handlers.CONTROL, "", IDS)


def protector(run_dir, **options) -> Protector:
    model = torch.nn.Linear(2, 2)
    made = Protector(run_dir, states={"model": model, "optim": torch.optim.SGD(model.parameters(), lr=0.1)},
                     **options)
    made.begin(integration="plain")
    return made


def test_a_loop_with_no_micro_batch_is_told_the_throttle_was_not_applied(tmp_path):
    guarded = protector(tmp_path)
    handlers.HANDLERS[COST_THROTTLE](guarded, THROTTLE)
    guarded.close()
    [event] = [e for e in events(tmp_path, "action") if e["action"] == "cost_throttle"]
    assert event["micro_batch"] == "unchanged" and "not available" in event["not_applied"]
    assert "micro_batch_size" not in event and guarded.state.micro_batch == 0


def test_a_kept_micro_batch_is_cut_by_a_quarter_and_handed_to_the_loop(tmp_path):
    handed = []
    guarded = protector(tmp_path, callbacks=Callbacks(cut_micro_batch=lambda size: handed.append(size) or {}))
    guarded.state.micro_batch = 8
    handlers.HANDLERS[COST_THROTTLE](guarded, THROTTLE)
    guarded.close()
    [event] = [e for e in events(tmp_path, "action") if e["action"] == "cost_throttle"]
    assert (event["micro_batch_before"], event["micro_batch_size"], handed) == (8, 6, [6])
    assert "not_applied" not in event
