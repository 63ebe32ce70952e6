"""The score itself (bench/bench_efficacy.py): a right action counts, a wrong one counts against, and the
real logs are skipped with the reason said when their folder is absent."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from tests.efficacy import corpus

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_efficacy.py"


def bench():
    spec = importlib.util.spec_from_file_location("bench_efficacy", BENCH)
    module = sys.modules["bench_efficacy"] = importlib.util.module_from_spec(spec)   # its dataclasses need it
    spec.loader.exec_module(module)
    return module


def test_the_score_counts_right_and_wrong_actions(tmp_path):
    efficacy = bench()
    from trainguard.policy import GuardPolicy, Policy

    spike = corpus.spike(seed=0, steps=600)
    right = efficacy.score_case(spike, tmp_path, Policy(), None)
    assert right.hits and not right.misses and not right.wrong
    # The same spike through a guard that cannot see it (sigma 1000, no warm-up rule to speak of): a miss.
    blind = Policy(guard=GuardPolicy(spike_sigma=1000.0, grad_explode_factor=1000.0, warmup_spike_factor=1000.0,
                                     grad_climb_sigma=1000.0))
    missed = efficacy.score_case(spike, tmp_path / "blind", blind, None)
    assert missed.misses and not missed.hits
    # A healthy data-mix change through a guard that takes no level shift (every loss-only step counted).
    eager = Policy(guard=GuardPolicy(shift_grad_factor=1.0000001, shift_loss_factor=1.0000001))
    mix = corpus.data_mix_change(seed=0, steps=3000)
    wrong = efficacy.score_case(mix, tmp_path / "eager", eager, None)
    assert any(name == "rollback" for _, name, _ in wrong.wrong)
    summary = efficacy.summarise([right, missed, wrong])
    rollback = summary["rows"]["action:rollback"]
    assert rollback["fp"] == 1 and summary["harmful_on_healthy"] >= 1


def test_the_real_logs_are_skipped_with_the_reason_when_absent(tmp_path, capsys, monkeypatch):
    efficacy = bench()
    monkeypatch.setattr(corpus, "REAL_LOGS", tmp_path / "no-such-folder")
    monkeypatch.setattr(corpus, "generated", lambda scale: iter([corpus.healthy(0, 400)]))
    out = tmp_path / "score.json"
    assert efficacy.main(["--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "real logs skipped" in text and "no-such-folder" in text
    assert json.loads(out.read_text())["summary"]["cases"] == 1
    assert list(corpus.real(tmp_path / "no-such-folder")) == []
