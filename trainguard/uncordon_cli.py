"""`trainguard uncordon RUN HOST`: let a cordoned node's launcher join the job again (trainguard/incidents_cli.py)."""

from trainguard.incidents_cli import add_uncordon_arguments as add_arguments, run_uncordon as run

__all__ = ["add_arguments", "run"]
