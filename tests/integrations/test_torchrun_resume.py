"""The Transformers and Lightning examples under torchrun, as users launch them: a run of 4 steps, then the
same command to 8 resumes from the checkpoint of step 4 (under torchrun the Trainer's `args.device` is
`cpu:0`, which torch.load refused, so every restart died before its first step)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.helpers import events

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("example, framework", [("hf_trainer", "transformers"), ("lightning_module", "lightning")])
def test_an_example_under_torchrun_resumes_from_its_verified_checkpoint(example, framework, tmp_path):
    pytest.importorskip(framework)
    run = tmp_path / "run"
    for steps in (4, 8):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                               "--max-restarts", "0", str(ROOT / "examples" / f"{example}.py"), "--run-dir", str(run),
                               "--steps", str(steps), "--checkpoint-every", "2"],
                              cwd=tmp_path, capture_output=True, text=True, timeout=400)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert [e["step"] for e in events(run, "checkpoint_restored")] == [4]
    assert [(e["step"], e["reason"]) for e in events(run, "run_end")] == [(4, "completed"), (8, "completed")]
