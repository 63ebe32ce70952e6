"""decide/node_risk.py: the per-node risk score, its debounce, the reboot transient and the circuit breaker."""

from __future__ import annotations

import pytest

from trainguard.decide.node_risk import (DRAIN_AT_CHECKPOINT, GpuHealth, NodeReading, NodeRisk, NodeRiskPolicy,
                                         reading_from_tls, replay)

STEP = 60.0       # one reading a minute


def reading(node: str, t: float, *, sbe: float = 0, dbe: float = 0, rows: float = 0, pending: int = 0,
            failure: int = 0, xids: dict | None = None, lost: bool = False, width: int = 16, downgrades: int = 0,
            ib_down: float = 0, ib_symbols: float = 0) -> NodeReading:
    healthy = GpuHealth("0", {"ecc_sbe_volatile": 0, "ecc_dbe_volatile": 0, "remapped_rows": 0,
                              "pcie_link_width": 16, "pcie_max_link_width": 16})
    if lost:
        sick = GpuHealth("1", xids=xids or {}, lost=True)
    else:
        sick = GpuHealth("1", {"ecc_sbe_volatile": sbe, "ecc_dbe_volatile": dbe, "remapped_rows": rows,
                               "pcie_link_width": width, "pcie_max_link_width": 16, "pcie_downgrades": downgrades},
                         {"remap_pending": pending, "remap_failure": failure}, xids or {})
    return NodeReading(node, t, (healthy, sick), {"ib_link_downed": ib_down, "ib_symbol_errors": ib_symbols})


def test_a_healthy_node_is_never_at_risk():
    rule = NodeRisk()
    verdicts = [rule.observe(reading("n1", i * STEP, sbe=i // 30)) for i in range(600)]   # 2 corrected/h
    assert not any(v.at_risk or v.flagged for v in verdicts)
    assert max(v.score for v in verdicts) < 0.1


def test_a_degrading_node_is_flagged_once_after_consecutive_readings():
    rule = NodeRisk()
    verdicts = []
    for i in range(40):       # corrected errors climbing 10 a minute (600/h), rows remapped, one pending
        verdicts.append(rule.observe(reading("n1", i * STEP, sbe=10 * i, rows=i // 10, pending=int(i >= 10))))
    flagged = [v for v in verdicts if v.flagged]
    assert len(flagged) == 1 and flagged[0].action == DRAIN_AT_CHECKPOINT
    first_high = next(i for i, v in enumerate(verdicts) if v.score >= 0.6)
    assert verdicts.index(flagged[0]) == first_high + 2          # three readings in a row at or above 0.6
    assert set(flagged[0].signals) >= {"correctable_ecc", "remapped_rows", "remap_pending"}
    assert all(v.at_risk for v in verdicts[verdicts.index(flagged[0]):])


def test_one_bad_reading_is_not_a_trend():
    rule = NodeRisk()
    verdicts = [rule.observe(reading("n1", i * STEP)) for i in range(10)]
    verdicts.append(rule.observe(reading("n1", 10 * STEP, pending=1, width=8, downgrades=1)))  # 0.5: no
    verdicts += [rule.observe(reading("n1", i * STEP)) for i in range(11, 20)]
    assert not any(v.at_risk for v in verdicts)


def test_a_planned_reboot_flags_nothing():
    """Counters reset, the node away 8 minutes, an IB link down, a GPU lost then back, a narrow link at boot."""
    rule = NodeRisk()
    verdicts = [rule.observe(reading("n1", i * STEP, sbe=50 + i // 60, ib_down=2, ib_symbols=30)) for i in range(60)]
    t = 60 * STEP + 480.0                                              # back after the reboot
    verdicts.append(rule.observe(reading("n1", t, lost=True, ib_down=0)))      # GPU not up yet
    for i in range(1, 4):
        verdicts.append(rule.observe(reading("n1", t + i * STEP, width=8, downgrades=1, ib_down=1)))  # link retrains
    verdicts += [rule.observe(reading("n1", t + i * STEP, downgrades=1, ib_down=1)) for i in range(4, 120)]
    assert not any(v.at_risk or v.flagged or v.suppressed for v in verdicts)
    assert verdicts[61].settling


def test_hard_signals_count_while_settling():
    rule = NodeRisk()
    for i in range(5):
        rule.observe(reading("n1", i * STEP, sbe=100))
    verdicts = [rule.observe(reading("n1", 5 * STEP + i * STEP, failure=1)) for i in range(3)]   # counters reset
    assert verdicts[0].settling and verdicts[-1].flagged
    assert set(verdicts[-1].signals) == {"remap_failure"}


def test_application_xids_weigh_nothing_and_drain_class_xids_everything():
    rule = NodeRisk()
    for i in range(10):
        v = rule.observe(reading("n1", i * STEP, xids={13: i, 31: i, 43: i}))
    assert v.score == 0
    rule = NodeRisk(NodeRiskPolicy(consecutive=1))
    rule.observe(reading("n2", 0.0, xids={79: 0}))
    v = rule.observe(reading("n2", STEP, lost=True, xids={79: 1}))
    assert v.flagged and v.signals == {"xid_drain": 1.0}


def test_circuit_breaker_limits_flags_per_hour_fleet_wide():
    rule = NodeRisk(NodeRiskPolicy(max_flags_per_hour=2))
    flagged, suppressed = [], []
    for i in range(120):
        for node in ("n1", "n2", "n3"):
            v = rule.observe(reading(node, i * STEP, failure=1))
            if v.flagged:
                flagged.append((node, v.timestamp))
            if v.suppressed:
                suppressed.append((node, v.timestamp))
    assert [node for node, _ in flagged] == ["n1", "n2", "n3"]
    assert flagged[2][1] - flagged[0][1] >= 3600.0            # the third waits until the first is an hour old
    assert suppressed and all(node == "n3" and reason_t < flagged[2][1] for node, reason_t in suppressed)


def test_flags_made_elsewhere_count_against_the_budget():
    rule = NodeRisk(NodeRiskPolicy(max_flags_per_hour=1, consecutive=1))
    rule.note_flag(0.0)
    assert rule.observe(reading("n1", 10.0, failure=1)).suppressed == "circuit_open"
    assert rule.observe(reading("n1", 3601.0, failure=1)).flagged


def test_reading_from_a_node_tls_record():
    record = {"timestamp": 100.0, "node": "n1",
              "hardware": {"gpus": [{"gpu": 0, "lost": False, "ecc_sbe_volatile": 7, "remap_pending": 1,
                                     "pcie_link_width": 8, "pcie_max_link_width": 16, "xids": {"63": 2},
                                     "gpu_util": 98}]},
              "system": {"ib_symbol_errors": 3, "ib_link_downed": 1, "gpu_count": 1}}
    r = reading_from_tls(record)
    assert r is not None and r.node == "n1" and r.timestamp == 100.0
    assert r.gpus[0].counters == {"ecc_sbe_volatile": 7.0, "pcie_link_width": 8.0, "pcie_max_link_width": 16.0}
    assert r.gpus[0].states == {"remap_pending": 1.0} and r.gpus[0].xids == {63: 2}
    assert r.counters == {"ib_symbol_errors": 3.0, "ib_link_downed": 1.0}
    assert reading_from_tls({"timestamp": 1.0, "metrics": {"loss": 2.0}}) is None


def test_replay_gives_the_live_verdicts():
    readings = [reading("n1", i * STEP, failure=int(i > 5)) for i in range(12)]
    live = [v for v in map(NodeRisk().observe, readings) if v.at_risk or v.flagged or v.suppressed]
    assert replay(readings) == live and live[0].flagged


@pytest.mark.parametrize("field, value", [("threshold", 0.6), ("consecutive", 3), ("max_flags_per_hour", 2)])
def test_documented_defaults(field, value):
    assert getattr(NodeRiskPolicy(), field) == value


def health(node: str, t: float, *, isolate: int = 0, failures: int = 0, ras: int = 0, reset_xids: int = 0,
           base: int = 0) -> NodeReading:
    """A healthy GPU and the health_reports collector's cumulative counts (system.health_*), from `base`."""
    gpu = GpuHealth("0", {"ecc_sbe_volatile": 0, "ecc_dbe_volatile": 0}, xids={48: reset_xids} if reset_xids else {})
    return NodeReading(node, t, (gpu,), {"health_diag_isolate": base + isolate, "health_diag_failures": base + failures,
                                         "health_ras_not_responding": base + ras})


def test_a_dcgmi_isolate_verdict_drains_even_while_settling_and_another_failure_needs_company():
    rule = NodeRisk()
    verdicts = [rule.observe(health("n1", i * STEP)) for i in range(5)]
    t = 5 * STEP + 900.0                                  # back from a gap: settling; the boot-time diag fails
    verdicts += [rule.observe(health("n1", t + i * STEP, isolate=1)) for i in range(4)]
    assert verdicts[6].settling and verdicts[6].signals == {"diag_isolate": 1.0}
    assert [v.flagged for v in verdicts[5:]] == [False, False, True, False]
    soft = NodeRisk()
    alone = [soft.observe(health("n2", i * STEP, failures=int(i >= 5))) for i in range(20)]
    assert not any(v.at_risk for v in alone) and alone[10].signals == {"diag_failed": 0.4}


def test_ras_ranks_not_responding_corroborate_and_never_decide_alone():
    quiet = NodeRisk()
    alone = [quiet.observe(health("n1", i * STEP, ras=i)) for i in range(30)]       # a hang, every minute
    assert not any(v.at_risk for v in alone) and alone[20].signals == {"ras_not_responding": 0.2}
    rule = NodeRisk()
    both = [rule.observe(health("n1", i * STEP, ras=int(i >= 5), reset_xids=int(i >= 5))) for i in range(12)]
    assert any(v.flagged for v in both)
    assert set(next(v for v in both if v.flagged).signals) == {"ras_not_responding", "xid_reset"}


def test_health_counts_kept_across_an_agent_restart_are_not_a_reboot():
    rule = NodeRisk()
    verdicts = [rule.observe(health("n1", i * STEP, base=3)) for i in range(20)]
    assert not any(v.settling for v in verdicts)
    lost = rule.observe(health("n1", 20 * STEP))                 # the state file lost: counts back to 0
    assert lost.settling


def test_reading_from_a_node_record_with_only_health_counts():
    record = {"timestamp": 100.0, "node": "n1", "system": {"health_diag_isolate": 1, "health_diag_failures": 0,
                                                          "health_ras_not_responding": 2}}
    found = reading_from_tls(record)
    assert found is not None and found.counters == {"health_diag_isolate": 1.0, "health_diag_failures": 0.0,
                                                    "health_ras_not_responding": 2.0}


def test_a_planned_reboot_with_its_ranks_reported_missing_flags_nothing():
    """A reboot stops the node's ranks: RAS reports them missing before it goes and for 40 minutes after it is
    back (the gap's settle period, then past it): a soft signal alone, so no drain."""
    rule = NodeRisk()
    verdicts = [rule.observe(health("n1", i * STEP, ras=int(i >= 55) * (i - 54))) for i in range(60)]
    t = 60 * STEP + 480.0
    verdicts += [rule.observe(health("n1", t + i * STEP, ras=6 + i, reset_xids=0)) for i in range(40)]
    assert not any(v.at_risk or v.flagged for v in verdicts)
