"""The metric families trainguard exports, as pure functions of the state they render.

The agent's collectors read their sources (NVML, /proc, the TLS logs) and call these; replay's series
(trainguard/replay/series.py) feed them recorded logs and get the very same families, so an alert rule
is tested against what the agent really exports. Pure: no files, devices or sockets.
"""
