"""trainguard: observability and self-protection for large-model pretraining."""

__version__ = "0.1.0"
