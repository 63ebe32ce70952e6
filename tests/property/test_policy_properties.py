"""The policy loader: any YAML value at any key is a clear error naming file and key, or a policy that
the guard, the cost meter and the rule renderer all accept.

Values are drawn for the policy's own keys (so the ranges are really exercised, not only unknown keys):
numbers of every size and sign, NaN and infinities, booleans, strings (durations, bananas), lists, maps
and nulls. A policy that loads is run: the guard over steps with spikes and NaNs, the meter over a run,
and the rules rendered, with every `for:` a duration and no NaN or infinity in an expression.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from alerts import rules
from tests.property.conftest import examples
from trainguard import policy as policy_mod
from trainguard.decide.cost import CostMeter
from trainguard.decide.guard import Guard, StepStats


def leaf_keys() -> list[tuple[str, object]]:
    """Every "section.key" (and "cost.tiers.warn" ...) with its default."""
    out = []

    def walk(obj, prefix):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            name = f"{prefix}.{f.name}" if prefix else f.name
            if dataclasses.is_dataclass(value):
                walk(value, name)
            else:
                out.append((name, value))

    walk(policy_mod.Policy(), "")
    return out


KEYS = [name for name, _ in leaf_keys()]
DEFAULT_RULES = rules.render(policy_mod.Policy())
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-10**20, 10**20), st.integers(-3, 300),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(-2.0, 200.0),
    st.sampled_from(["30s", "2m", "1h30m", "0s", "banana", "", "5", "1e3", "nan", ".inf", "-1m"]),
    st.text(max_size=12))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                      max_leaves=6)


def nest(assignments: dict[str, object]) -> dict:
    data: dict = {}
    for dotted, value in assignments.items():
        *parents, last = dotted.split(".")
        holder = data
        for part in parents:
            holder = holder.setdefault(part, {}) if isinstance(holder.get(part, {}), dict) else {}
        holder[last] = value
    return data


def run_everything(policy: policy_mod.Policy) -> None:
    guard = Guard(policy.guard)
    for step in range(1, 120):
        loss = math.nan if step == 70 else 50.0 if step % 37 == 0 else 2.0 + 0.01 * (step % 5)
        guard.observe(StepStats(step, loss, 1.0 + (1e4 if step == 90 else 0.0), {"h.0": 0.5}, 1000.0 + step))
    meter = CostMeter(policy.cost)
    for step in range(1, 120):
        meter.observe(step, 1000.0 + 3.0 * step, gpu_count=8)
    for name, text in rules.render(policy).items():
        for group in yaml.safe_load(text)["groups"]:
            for rule in group["rules"]:
                if "for" in rule:
                    policy_mod.parse_duration(rule["for"])
                assert "nan" not in rule["expr"].lower(), (name, rule)
        assert text.count("Inf") == DEFAULT_RULES[name].count("Inf"), name    # no threshold became infinite


def load_and_run(path) -> None:
    """A named error (file first), or a policy the guard, the meter and the renderer all accept."""
    try:
        policy = policy_mod.load(path)
    except policy_mod.PolicyError as exc:
        assert str(exc).startswith(f"{path}: ")
        return
    run_everything(policy)


@settings(max_examples=examples(150))
@given(st.dictionaries(st.sampled_from(KEYS), VALUES, min_size=1, max_size=4))
def test_any_value_at_any_key_is_a_named_error_or_a_policy_everything_accepts(tmp_path_factory, assignments):
    path = tmp_path_factory.mktemp("p") / "policy.yaml"
    path.write_text(yaml.safe_dump(nest(assignments)))
    load_and_run(path)


@settings(max_examples=examples(100))
@given(st.binary(max_size=200))
def test_any_bytes_are_a_named_error_or_a_policy(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("p") / "policy.yaml"
    path.write_bytes(data)
    load_and_run(path)


def test_every_numeric_and_duration_key_has_a_rule_row():
    """A new key is declared with `key(default, range, doc)` (trainguard/config.py), which gives it its
    row in policy.RULES: this names any field declared without one."""
    missing = [name for name, default in leaf_keys()
               if isinstance(default, (int, float, str)) and not isinstance(default, bool) and name not in policy_mod.RULES]
    assert missing == [], f"declare with trainguard.config.key(default, range, doc): {', '.join(missing)}"


@pytest.mark.parametrize("text, named", [
    ("cost: {budget_per_1k_steps: 0}", "cost.budget_per_1k_steps: must be > 0"),
    ("guard: {spike_window: 0}", "guard.spike_window: must be >= 2"),
    ("guard: {rollback_window: 0}", "guard.rollback_window: must be >= 1"),
    ("cost: {price_per_gpu_hour: .nan}", "cost.price_per_gpu_hour: must be a finite number"),
    ("guard: {grad_ema_beta: 5.0}", "guard.grad_ema_beta: must be >= 0 and < 1"),
    ("alerts: {for_short: banana}", "alerts.for_short: not a duration"),
    ("cost: {window_steps: 100000000000000000000000}", "cost.window_steps: must be >= 1 and <= 1e+06"),
    ("guard: {rollback_after: 9, rollback_window: 5}", "guard.rollback_after: 9 bad steps can never fit"),
])
def test_the_issues_values_are_refused_naming_file_and_key(tmp_path, text, named):
    path = tmp_path / "policy.yaml"
    path.write_text(text + "\n")
    with pytest.raises(policy_mod.PolicyError) as caught:
        policy_mod.load(path)
    assert str(caught.value).startswith(f"{path}: {named}"), str(caught.value)


def test_a_policy_that_is_not_utf8_is_a_named_error(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_bytes(b"cost:\n  price_per_gpu_hour: 2.0  # \xff\xfe\n")
    with pytest.raises(policy_mod.PolicyError, match=r"policy.yaml: not UTF-8 \(invalid start byte at byte 35\)"):
        policy_mod.load(path)
