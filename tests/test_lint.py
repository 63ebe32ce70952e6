"""ruff over the whole tree (pyproject.toml [tool.ruff]: pyflakes and bugbear, the rules that find bugs)."""

from tests.dev_tools import run_dev_tool


def test_the_tree_is_clean_under_ruff():
    done = run_dev_tool("ruff", "check", "--output-format", "concise", ".", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
