"""What happened in a run, in a few plain sentences and headline numbers (the report's top, and `status`)."""

from __future__ import annotations

from dataclasses import dataclass

from trainguard import actions, event_types
from trainguard.report.charts import format_elapsed, format_value
from trainguard.report.charts import mfu_na
from trainguard.report.data import Run, final

# The report groups actions as the action table does (its `group`): the guard's and recovery's, and cost's.
GUARD_ACTIONS = actions.REPORTED_GUARD_ACTIONS
COST_ACTIONS = actions.COST_ACTIONS


@dataclass
class Tile:
    label: str
    value: str
    tone: str = ""        # "" | "good" | "warn" | "bad"
    hint: str = ""        # what the number counts, and why it has its colour (shown under the card)


def _counted(counter, names=None) -> str:
    items = [(k, v) for k, v in counter.most_common() if names is None or k in names]
    return ", ".join(f"{name} ×{count}" if count > 1 else name for name, count in items)


def _num(value: float | None, unit: str = "") -> str:
    return "n/a" if value is None else format_value(value, unit)


def describe_hardware(run: Run) -> str:
    if run.gpus:
        models = sorted(set(run.gpu_names.values()))
        return f"{len(run.gpus)} GPU(s)" + (f" ({', '.join(models)})" if models else "")
    if run.hosts:
        return "no GPUs (a CPU run: the agent found none)"
    return "no GPUs recorded (no agent ran beside the trainer, and the trainer saw none)"


def sentences(run: Run) -> list[str]:
    out = []
    nodes = len(run.hosts) or 1
    if run.last_step is None:
        out.append(f"No training steps were recorded in {run.run_dir} ({run.records} records read).")
    else:
        out.append(f"Trained steps {run.first_step}–{run.last_step} ({run.step_records} step records from rank "
                   f"{run.primary_rank if run.primary_rank is not None else '?'} of {len(run.ranks) or 1}) over "
                   f"{format_elapsed(run.duration)} on {nodes} node(s) with {describe_hardware(run)}.")
    loss = run.training.get("loss")
    if loss:
        low = loss.y_range()[0]
        text = f"Loss went from {loss.first[1]:.4g} to {loss.last[1]:.4g} (lowest {low:.4g})"
        if loss.nonfinite:
            text += f"; {loss.nonfinite} step(s) logged a non-finite loss"
        out.append(text + ".")
    tokens, mfu = run.training.get("tokens_per_second"), run.training.get("mfu")
    if tokens:
        text = f"Throughput averaged {format_value(tokens.mean, 'tok/s')}"
        if len(run.ranks) > 1:
            text += f" per rank ({len(run.ranks)} ranks)"
        out.append(text + (f", MFU {format_value(mfu.mean, 'ratio')}." if mfu else f"; MFU {mfu_na(run.mfu_unavailable)}."))
    out.append(f"Injected faults: {', '.join(run.faults)}." if run.faults else "No faults were injected.")
    guard = _counted(run.actions, GUARD_ACTIONS)
    out.append(f"Guard and recovery actions: {guard}." if guard else "The guard took no action.")
    if run.shadowed or run.shadow_mode:
        out.append(shadow_sentence(run))
    if run.restarts:
        out.append(f"The run restarted {run.restarts} time(s), each resuming from its latest verified checkpoint.")
    out.append(f"Alerts fired: {_counted(run.alerts)}." if run.alerts else "No alerts fired.")
    cost = _cost_sentence(run)
    if cost:
        out.append(cost)
    if run.checkpoints or run.event_counts.get(event_types.CHECKPOINT_SAVED):
        saved = run.event_counts.get(event_types.CHECKPOINT_SAVED, 0)
        verified = sum(1 for c in run.checkpoints if c.manifest is not None)
        out.append(f"{saved} checkpoint(s) saved; {len(run.checkpoints)} on disk ({verified} with a manifest),"
                   f" latest {run.last_checkpoint or 'none'}.")
    else:
        out.append("No checkpoints were saved.")
    goodput = goodput_sentence(run)
    if goodput:
        out.append(goodput)
    if run.malformed:
        out.append(f"{run.malformed} malformed log line(s) could not be read (listed at the end).")
    return out


def shadow_sentence(run: Run) -> str:
    """Shadow mode (docs/trainer.md#shadow-mode): what would have been done, none of it carried out."""
    if not run.shadowed:
        return "Shadow mode: no action would have been taken."
    return (f"Shadow mode: trainguard would have taken {_counted(run.shadowed)}; none was carried out "
            "(the shadow_action events in the list below say when and why).")


def _cost_sentence(run: Run) -> str:
    state, policy = run.cost_state, run.policy.cost
    if state is None or not run.cost.get("cost_usd"):
        return ""
    if not state.gpu_count:
        return ("Cost was not metered: the run recorded no GPUs (a CPU run); set cost.gpu_count_override "
                "in the policy to bill it as that many devices.")
    taken = _counted(run.actions, COST_ACTIONS)
    return (f"Spent {format_value(state.cost_usd, 'usd')} at {format_value(policy.price_per_gpu_hour, 'usd')}"
            f" per GPU-hour on {state.gpu_count or 0} billable device(s); the latest cost per 1000 steps is "
            f"{format_value(state.cost_per_1k_steps, 'usd')} against a budget of "
            f"{format_value(policy.budget_per_1k_steps, 'usd')} (tier {state.tier})"
            + (f"; cost actions: {taken}." if taken else "."))


def goodput_sentence(run: Run) -> str:
    shares = goodput_shares(run)
    if not shares:
        return ""
    good = shares.get("goodput", 0.0)
    bad = sorted(((k, v) for k, v in shares.items() if k != "goodput" and v >= 0.005), key=lambda kv: -kv[1])
    text = f"Goodput {good:.0%} of wall time"
    listed = ", ".join(f"{k.replace('_', ' ')} {v:.0%}" for k, v in bad[:5])
    return text + (f"; badput: {listed}." if bad else ".")


def goodput_shares(run: Run) -> dict[str, float]:
    """{'goodput': share, <badput cause>: share, ...} from trainguard.goodput's result, if it ran."""
    result = run.goodput
    if result is None:
        return {}
    total = float(getattr(result, "total_seconds", 0.0) or 0.0)
    if total <= 0:
        return {}
    shares = {"goodput": float(result.productive_seconds) / total}
    for cause, seconds in dict(result.badput_seconds).items():
        shares[str(cause)] = float(seconds) / total
    return shares


def _loss_hint(run: Run, loss) -> str:
    if loss is None:
        return "no loss recorded"
    text = f"loss of the last step with a finite loss (rank {run.primary_rank})"
    if loss.nonfinite:
        text += f"; red: {loss.nonfinite} step(s) logged a non-finite loss (NaN or Inf)"
    return text


def _goodput_hint(shares: dict[str, float]) -> str:
    bad = sorted(((k, v) for k, v in shares.items() if k != "goodput" and v >= 0.005), key=lambda kv: -kv[1])
    text = "share of wall time spent in steps that were kept (not thrown away, skipped, stalled or waiting on data)"
    return text + ("; the rest: " + ", ".join(f"{k.replace('_', ' ')} {v:.0%}" for k, v in bad[:3]) if bad else "")


def tiles(run: Run) -> list[Tile]:
    loss = run.training.get("loss")
    ranks = len(run.ranks) or 1
    steps_hint = ("no step records" if run.last_step is None else
                  f"last step reached; {run.step_records:,} step records"
                  + (f", {len(run.passes) - 1} rollback(s)/restart(s) repeated steps" if len(run.passes) > 1 else ""))
    out = [
        Tile("steps", "n/a" if run.last_step is None else f"{run.last_step:,}", hint=steps_hint),
        Tile("final loss", _num(final(loss)), "bad" if loss and loss.nonfinite else "", hint=_loss_hint(run, loss)),
        Tile("tokens/s" + (" per rank" if ranks > 1 else ""),
             _num(run.training["tokens_per_second"].mean, "") if run.training.get("tokens_per_second") else "n/a",
             hint=f"mean over rank {run.primary_rank}'s step records" + (f"; ×{ranks} for the job" if ranks > 1 else "")),
        Tile("MFU", _num(run.training["mfu"].mean, "ratio") if run.training.get("mfu") else "n/a",
             hint="mean model FLOPs utilisation: achieved FLOP/s over the device's documented peak"
             if run.training.get("mfu") else mfu_na(run.mfu_unavailable)),
        Tile("wall time", format_elapsed(run.duration),
             hint="first to last record of the charted rank, stalls and restarts included"),
    ]
    taken = sum(run.actions[a] for a in GUARD_ACTIONS)
    listed = _counted(run.actions, GUARD_ACTIONS)
    out.append(Tile("guard actions", str(taken), "warn" if taken else "good",
                    hint=(f"{listed}; amber: the run needed protecting" if taken else
                          "skip_step, rollback, restore or stop: none needed")
                    + (f"; {run.restarts} restart(s)" if run.restarts else "")))
    if run.shadowed or run.shadow_mode:
        out.append(Tile("shadow actions", str(sum(run.shadowed.values())), "warn" if run.shadowed else "good",
                        hint=(f"would have taken {_counted(run.shadowed)}; none carried out (shadow mode)"
                              if run.shadowed else "shadow mode: nothing would have acted")))
    out.append(Tile("alerts", str(sum(run.alerts.values())), "warn" if run.alerts else "good",
                    hint=f"alerts that fired: {_counted(run.alerts)}" if run.alerts else "no alert fired"))
    if run.cost_state is not None and run.cost_state.gpu_count and run.cost.get("cost_usd"):
        tier = run.cost_state.tier
        out.append(Tile("spend", format_value(run.cost_state.cost_usd, "usd"),
                        {"ok": "good", "warn": "warn"}.get(tier, "bad"),
                        hint=f"metered at {format_value(run.policy.cost.price_per_gpu_hour, 'usd')} per GPU-hour on "
                             f"{run.cost_state.gpu_count} device(s); cost tier {tier}"))
    shares = goodput_shares(run)
    if shares:
        good = shares.get("goodput", 0.0)
        out.append(Tile("goodput", f"{good:.0%}", "good" if good >= 0.9 else "warn",
                        hint=_goodput_hint(shares) + ("" if good >= 0.9 else "; amber: under 90%")))
    if run.malformed:
        out.append(Tile("malformed lines", str(run.malformed), "bad",
                        hint="log lines that could not be read, listed with file and line at the end"))
    return out
