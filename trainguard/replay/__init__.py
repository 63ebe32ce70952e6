"""`trainguard replay`: recorded TLS logs through the guard, the cost meter and the alert rules.

    source.py    inputs -> one time-ordered stream of typed records (msgspec fast path, lenient fallback)
    engine.py    the live run's own Guard and CostMeter over the stream, in the log's time
    series.py    the series the agent would have exported (its own collectors), on a scrape grid
    rules.py     those series through Prometheus's rule engine (promtool test rules)
    expect.py    expected actions and alerts, and the readable diff
    timeline.py  all of it end to end, and the JSON document
    cli.py       the command
"""

from trainguard.replay.timeline import Result, replay_logs

__all__ = ["Result", "replay_logs"]
