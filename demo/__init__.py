"""`trainguard demo`: the whole product on one machine (installed as trainguard.demo).

It runs the trainer and the agent and, with --with-prometheus, the alert rules under real servers, so it
sits above every other package and nothing imports it (docs/architecture.md, "Layers").
"""
