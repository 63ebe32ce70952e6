"""Headless Chromium for report tests: load a file, return its DOM after scripts ran and what it logged."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.servers import require_binary

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
         "--enable-logging=stderr", "--v=0")
CONSOLE = re.compile(r":CONSOLE[:(]\d*\)?\]? ?(.*)")


def chromium(html: Path, tmp_path: Path, *, screenshot: Path | None = None,
             size: tuple[int, int] = (1400, 2400), fragment: str = "") -> tuple[str, list[str]]:
    """(DOM after load, console messages) of `html` (at `#fragment` when given); a screenshot too when asked."""
    binary = require_binary("chromium", "chromium-browser")
    profile = tmp_path / f"chromium-profile-{len(list(tmp_path.glob('chromium-profile-*')))}"
    action = [f"--screenshot={screenshot}", f"--window-size={size[0]},{size[1]}"] if screenshot else ["--dump-dom"]
    done = subprocess.run([binary, *FLAGS, f"--user-data-dir={profile}", *action, html.resolve().as_uri() + (f"#{fragment}" if fragment else "")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    console = [m.group(1) for line in done.stderr.splitlines() if (m := CONSOLE.search(line))]
    return done.stdout, console
