"""mypy, strict, over the pure decision core and the TLS codec (pyproject.toml [tool.mypy]:
trainguard/decide/, trainguard/tls.py)."""

from tests.dev_tools import run_dev_tool


def test_the_decision_core_type_checks_strictly():
    done = run_dev_tool("mypy", "--no-error-summary")
    assert done.returncode == 0, done.stdout + done.stderr
