"""The run report (`trainguard report`) and the terminal view (`trainguard status`).

    from trainguard.report import write_report
    path = write_report("runs/demo")            # -> runs/demo/report.html
"""

from __future__ import annotations

import os
from pathlib import Path

from trainguard import rundir

__all__ = ["Run", "load_run", "render_report", "write_report"]


def __getattr__(name: str):
    """`Run` and `load_run` are the loader's (data.py), imported when asked for: `trainguard status`, also
    in this package, reads a log's tail without the loader, the policy and the cost meter it brings."""
    if name in ("Run", "load_run"):
        from trainguard.report import data

        return getattr(data, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def render_report(run_dir: str | os.PathLike, policy=None, goodput: bool = True) -> str:
    """The HTML report of a run directory, as a string."""
    from trainguard.report.data import load_run
    from trainguard.report.html import render

    return render(load_run(run_dir, policy=policy, goodput=goodput))


def write_report(run_dir: str | os.PathLike, out: str | os.PathLike | None = None, policy=None,
                 goodput: bool = True) -> Path:
    """Write the report (default RUN/report.html) atomically and return its path."""
    target = Path(out) if out is not None else rundir.report_path(run_dir)
    html = render_report(run_dir, policy=policy, goodput=goodput)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        partial.write_text(html, encoding="utf-8")
        os.replace(partial, target)   # a browser reloading the report never sees half a file
    except BaseException:
        partial.unlink(missing_ok=True)   # a full disk or a directory in the way leaves no .tmp behind
        raise
    return target
