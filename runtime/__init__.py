"""The library's runtime: what a running job's two sides share (installed as trainguard.runtime).

The checkpoint store, step telemetry, the control channel, the cordon key, the Flight Recorder's request
and dump, the preflight result file. The protection library (protect/) and the bundled trainer use them in
the training process; the agent uses the same modules to ask, sign and read from beside it. They sit here,
above the core and below both, so that the agent imports nothing of the trainer (docs/architecture.md,
"Layers").
"""
