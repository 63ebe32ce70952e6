"""The ledger: alert -> action, de-duplication, supersession, coalescing, rate limits, shadow, memory."""

from trainguard import actions
from trainguard.decide.decision import Decision
from trainguard.decide.ledger import (ACT, COALESCED, DUPLICATE, ESCALATED, NO_ACTION, RESOLVED, SUPERSEDED,
                                      Ledger, Limits, Notice)
from trainguard.policy import Policy


def firing(name="LossSpike", action=actions.ROLLBACK, key="fp1@t0", **kw):
    return Notice(alertname=name, status="firing", action=action, key=key, **kw)


def resolved(name="LossSpike", action=actions.ROLLBACK, key="fp1@t0"):
    return Notice(alertname=name, status="resolved", action=action, key=key)


def test_an_alert_acts_once_however_often_alertmanager_repeats_it():
    ledger = Ledger()
    first = ledger.decide(firing(), now=100.0)
    repeats = [ledger.decide(firing(), now=100.0 + 15 * i) for i in range(1, 5)]
    assert (first.outcome, first.action, first.executes) == (ACT, actions.ROLLBACK, True)
    assert {v.outcome for v in repeats} == {DUPLICATE}
    assert not any(v.executes for v in repeats)


def test_resolved_closes_and_never_acts():
    ledger = Ledger()
    ledger.decide(firing(), now=0.0)
    closed = ledger.decide(resolved(), now=10.0)
    stray = ledger.decide(resolved(key="never-seen"), now=11.0)
    assert (closed.outcome, closed.action, closed.reason) == (RESOLVED, None, "closed")
    assert (stray.outcome, stray.executes, stray.reason) == (RESOLVED, False, "not open here")
    assert ledger.open == set()


def test_the_same_alert_firing_again_later_is_a_new_incident():
    ledger = Ledger(Limits(cooldown_seconds=60))
    assert ledger.decide(firing(key="fp1@t0"), 0.0).outcome == ACT
    ledger.decide(resolved(key="fp1@t0"), 30.0)
    assert ledger.decide(firing(key="fp1@t1"), 500.0).outcome == ACT


def test_an_alert_without_an_action_is_recorded_only():
    verdict = Ledger().decide(firing(name="GPUOverheating", action=None), 0.0)
    assert (verdict.outcome, verdict.action, verdict.executes) == (NO_ACTION, None, False)


def test_cost_tiers_arriving_together_act_in_order_each_once():
    ledger = Ledger()
    batch = [firing("CostBudgetStop", actions.COST_STOP, "c3"), firing("CostBudgetWarn", actions.COST_WARN, "c1"),
             firing("CostBudgetThrottle", actions.COST_THROTTLE, "c2")]
    verdicts = ledger.decide_all(batch, now=0.0)
    assert [(v.notice.alertname, v.outcome, v.action) for v in verdicts] == [
        ("CostBudgetWarn", ACT, actions.COST_WARN), ("CostBudgetThrottle", ACT, actions.COST_THROTTLE),
        ("CostBudgetStop", ACT, actions.COST_STOP)]


def test_a_weaker_tier_after_a_stronger_one_is_superseded():
    ledger = Ledger()
    assert ledger.decide(firing("CostBudgetThrottle", actions.COST_THROTTLE, "c2"), 0.0).outcome == ACT
    late_warn = ledger.decide(firing("CostBudgetWarn", actions.COST_WARN, "c1"), 1.0)
    assert (late_warn.outcome, late_warn.executes) == (SUPERSEDED, False)


def test_each_tier_acts_once_whichever_path_saw_it_first():
    ledger = Ledger()
    embedded = Notice.from_decision(Decision(actions.COST_WARN, "cost_overrun_warn", 120, 50.0),
                                    "CostBudgetWarn", key="embedded:cost_warn")
    assert ledger.decide(embedded, 50.0).outcome == ACT
    from_alert = ledger.decide(firing("CostBudgetWarn", actions.COST_WARN, "fp9@t5"), 80.0)
    assert (from_alert.outcome, from_alert.executes) == (DUPLICATE, False)


def test_rollbacks_within_the_cooldown_join_the_first():
    ledger = Ledger(Limits(cooldown_seconds=120))
    spike = ledger.decide(firing("LossSpike", key="a"), 0.0)
    grad = ledger.decide(firing("GradNormExplosion", key="b"), 30.0)
    later = ledger.decide(firing("LossSpike", key="c"), 200.0)
    assert [spike.outcome, grad.outcome, later.outcome] == [ACT, COALESCED, ACT]


def test_rollbacks_past_the_hourly_limit_escalate_to_a_clean_stop_once():
    ledger = Ledger(Limits(cooldown_seconds=0, max_rollbacks_per_hour=2))
    outcomes = [ledger.decide(firing(key=f"k{i}"), 60.0 * i) for i in range(4)]
    assert [v.outcome for v in outcomes] == [ACT, ACT, ESCALATED, SUPERSEDED]
    assert outcomes[2].action == actions.COST_STOP and outcomes[2].executes
    assert outcomes[2].reason == "rollback_limit"
    assert ledger.decide(firing("CostBudgetStop", actions.COST_STOP, "s"), 300.0).outcome == DUPLICATE


def test_the_rollback_limit_is_a_sliding_hour():
    ledger = Ledger(Limits(cooldown_seconds=0, max_rollbacks_per_hour=1))
    assert ledger.decide(firing(key="a"), 0.0).outcome == ACT
    assert ledger.decide(firing(key="b"), 3599.0).outcome == ESCALATED
    fresh = Ledger(Limits(cooldown_seconds=0, max_rollbacks_per_hour=1))
    fresh.decide(firing(key="a"), 0.0)
    assert fresh.decide(firing(key="b"), 3601.0).outcome == ACT


def test_restores_past_the_limit_page_a_human_and_execute_nothing():
    ledger = Ledger(Limits(cooldown_seconds=0, max_restores_per_hour=1))
    stall = dict(name="TrainingStalled", action=actions.RESTORE)
    assert ledger.decide(firing(key="a", **stall), 0.0).outcome == ACT
    paged = ledger.decide(firing(key="b", **stall), 100.0)
    assert (paged.outcome, paged.action, paged.executes) == (ESCALATED, actions.PAGE, False)
    assert paged.detail == {"restores_last_hour": 1}


def test_limits_come_from_the_policy():
    limits = Limits.from_policy(Policy())
    assert limits.max_rollbacks_per_hour == Policy().guard.max_rollbacks_per_hour
    assert limits.max_restores_per_hour == Policy().alerts.max_restores_per_hour
    assert limits.cooldown_seconds == Policy().alerts.action_cooldown_seconds


def test_shadow_decides_the_same_but_executes_nothing():
    live, dry = Ledger(), Ledger(shadow=True)
    notices = [firing(key="a"), firing(key="a"), firing("CostBudgetWarn", actions.COST_WARN, "c")]
    live_verdicts = [live.decide(n, 0.0) for n in notices]
    dry_verdicts = [dry.decide(n, 0.0) for n in notices]
    assert [v.outcome for v in dry_verdicts] == [v.outcome for v in live_verdicts] == [ACT, DUPLICATE, ACT]
    assert [v.action for v in dry_verdicts] == [actions.ROLLBACK, None, actions.COST_WARN]
    assert not any(v.executes for v in dry_verdicts)
    assert [v.would_execute for v in dry_verdicts] == [True, False, True]
    assert all(v.as_event()["shadow"] for v in dry_verdicts)


def test_a_restarted_ledger_remembers_what_it_decided():
    first = Ledger(Limits(cooldown_seconds=120))
    events = [v.as_event() for v in first.decide_all(
        [firing(key="a"), firing("CostBudgetThrottle", actions.COST_THROTTLE, "c")], now=10.0)]
    second = Ledger(Limits(cooldown_seconds=120))
    for event in events:
        second.remember(event)
    assert second.decide(firing(key="a"), 20.0).outcome == DUPLICATE
    assert second.decide(firing(key="b"), 30.0).outcome == COALESCED          # cooldown survived
    assert second.decide(firing("CostBudgetWarn", actions.COST_WARN, "w"), 40.0).outcome == SUPERSEDED


def test_a_live_ledger_owes_nothing_to_a_shadow():
    dry = Ledger(shadow=True)
    events = [dry.decide(firing(key="a"), 0.0).as_event(),
              {**Ledger().decide(firing(key="b"), 0.0).as_event(), "dry_run": True}]   # an older agent's record
    live = Ledger()
    for event in events:
        live.remember(event)
    assert live.decide(firing(key="a"), 5.0).outcome == ACT
    assert live.decide(firing(key="b"), 500.0).outcome == ACT


def test_the_recorded_event_names_the_alert_and_the_decision():
    verdict = Ledger().decide(firing(starts_at=12.5, step=40), 13.0)
    event = verdict.as_event()
    assert event["type"] == "alert" and event["alertname"] == "LossSpike"
    assert (event["outcome"], event["action"], event["requested"], event["key"]) == (ACT, "rollback", "rollback",
                                                                                     "fp1@t0")
    assert (event["starts_at"], event["step"], event["decided_at"]) == (12.5, 40, 13.0)
