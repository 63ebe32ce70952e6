"""trainguard as users install it: the sdist and the wheel built as pip builds them (the wheel from the
sdist, so the sdist is proven complete too), the wheel installed into a fresh virtual environment outside
the checkout, and the product run from there: `--version`, the demo, `report`, `replay`, `alerts test`,
`alerts render`/`dashboards render` and the three examples, each from a folder that is not the checkout.

The fresh environment gets trainguard from the wheel alone; its dependencies (torch, transformers, ...)
come from this interpreter's site-packages through a .pth line, so the test downloads nothing. A .pth
line adds a folder without running the .pth files in it, so the checkout's editable install (a finder
started by a .pth in site-packages) does not reach the fresh environment: the test checks that
`trainguard` is imported from the installed wheel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import trainguard
from tests.servers import require_binary
from tests.test_layers import roots

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
# The folders setup.py installs as trainguard's packages (its ROOTS), where the data files live.
PACKAGE_FOLDERS = {"trainguard": "trainguard", "runtime": "trainguard/runtime", "agent": "trainguard/agent",
                   "trainer": "trainguard/trainer", "protect": "trainguard/protect",
                   "preflight": "trainguard/preflight", "alerts": "trainguard/alerts",
                   "dashboards": "trainguard/dashboards", "demo": "trainguard/demo"}


class Installed:
    def __init__(self, tmp: Path):
        self.dist, self.venv, self.work = tmp / "dist", tmp / "venv", tmp / "work"
        self.work.mkdir(parents=True)
        self.python = self.venv / "bin" / "python"
        # no PYTHONPATH (it would put the checkout back); a checkpoint key of the test's own
        self.env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.env.update(TRAINGUARD_CHECKPOINT_KEY=str(tmp / "keys" / "checkpoint.key"), TRAINGUARD_LOG_JSON="0",
                        PATH=f"{self.venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")

    @property
    def wheel(self) -> Path:
        return next(self.dist.glob("trainguard-*.whl"))

    def run(self, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(argv, cwd=self.work, env=self.env, capture_output=True, text=True, timeout=timeout)

    def start(self, *argv: str) -> subprocess.Popen:
        return subprocess.Popen(argv, cwd=self.work, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)


def dependency_folders() -> list[str]:
    """This interpreter's import folders that hold installed packages, not the checkout."""
    keep = []
    for entry in sys.path:
        path = Path(entry or ".").resolve()
        inside_checkout = path == ROOT or (ROOT in path.parents and ROOT / ".venv" not in (path, *path.parents))
        if path.is_dir() and not inside_checkout and path != Path(sysconfig.get_paths()["stdlib"]).resolve():
            keep.append(str(path))
    return keep


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    pytest.importorskip("build", reason="the `build` frontend is a dev dependency (scripts/setup installs it)")
    where = Installed(tmp_path_factory.mktemp("wheel"))
    # sdist, then the wheel from the unpacked sdist, as `pip install` of an sdist would; no isolation, so
    # nothing is downloaded (pyproject.toml's build requirements are dev dependencies)
    built = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(where.dist), str(ROOT)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where.venv)], check=True, timeout=120)
    site = Path(subprocess.run([str(where.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "_trainguard_test_dependencies.pth").write_text("\n".join(dependency_folders()) + "\n")
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(where.python), "install", "--no-deps",
                           "--no-index", "-q", str(where.wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return where


def test_the_wheel_and_the_sdist_hold_every_module_and_data_file_the_product_reads(installed):
    """Every tracked file of every package folder: a data file pyproject.toml's package-data leaves out, a
    module in a folder without __init__.py, a package setup.py's ROOTS does not map, each fails here."""
    assert set(PACKAGE_FOLDERS) == set(roots().values())
    tracked = subprocess.run(["git", "ls-files", *PACKAGE_FOLDERS], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout: the tracked files are unknown")
    files = [Path(p) for p in tracked.stdout.split()]
    wheel = set(zipfile.ZipFile(installed.wheel).namelist())
    expected = {f"{PACKAGE_FOLDERS[p.parts[0]]}/{Path(*p.parts[1:]).as_posix()}" for p in files}
    assert expected - wheel == set()
    assert {"trainguard/runtime/checkpoint/manager.py", "trainguard/demo/stack.py"} <= wheel
    assert {"trainguard/schema/tls-v1.schema.json", "trainguard/report/assets/report.css",
            "trainguard/trainer/configs/tiny.yaml", "trainguard/agent/configs/agent.yaml",
            "trainguard/alerts/tests/training.test.yml"} <= wheel


def start_examples(installed: Installed) -> tuple[dict[str, subprocess.Popen], list[str]]:
    """`python examples/NAME.py ...` from a folder holding only the examples (no `examples` package on the
    path, no checkout), each as its header says: it imports nothing but trainguard and its framework."""
    shutil.copytree(ROOT / "examples", installed.work / "examples", ignore=shutil.ignore_patterns("__*"))
    wanted = {"plain_loop": None, "hf_trainer": "transformers", "lightning_module": "lightning"}
    running, missing = {}, []
    for name, needs in wanted.items():
        if needs and subprocess.run([str(installed.python), "-c", f"import {needs}"], env=installed.env).returncode:
            missing.append(needs)
            continue
        running[name] = installed.start(str(installed.python), f"examples/{name}.py", "--run-dir", f"runs/{name}",
                                        "--steps", "6", "--inject", "nan@3", "--checkpoint-every", "3")
    return running, missing


def test_the_installed_commands_and_the_examples_run_outside_the_checkout(installed):
    """The examples run beside the commands (they wait on imports more than on the CPU), checked at the end."""
    examples, missing = start_examples(installed)
    try:
        run_the_commands(installed)
    finally:
        outputs = {name: process.communicate(timeout=600)[0] for name, process in examples.items()}
    assert "plain_loop" in examples
    for name, process in examples.items():
        assert process.returncode == 0 and "exit_code=" in outputs[name], f"{name}:\n{outputs[name][-3000:]}"
        log = (installed.work / "runs" / name / "tls" / "rank-0.jsonl").read_text().replace(" ", "")
        assert '"skip_step","reason":"nan"' in log, name
    if missing:
        pytest.skip(f"the examples of {missing} did not run: not installed")


def run_the_commands(installed: Installed) -> None:
    where = installed.run(str(installed.python), "-c", "import trainguard; print(trainguard.__file__)")
    assert where.returncode == 0 and Path(where.stdout.strip()).is_relative_to(installed.venv), where.stdout
    version = installed.run("trainguard", "--version")
    assert version.stdout.strip() == f"trainguard {trainguard.__version__}"

    demo = installed.run("trainguard", "demo", "--run-dir", "demo", "--steps", "30")
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]     # trains the `tiny` preset
    assert "faults injected: nan@5" in demo.stdout and "no loss-spike burst" in demo.stdout
    run = installed.work / "demo"
    assert '"skip_step","reason":"nan"' in (run / "tls" / "rank-0.jsonl").read_text().replace(" ", "")

    report = installed.run("trainguard", "report", "demo", "-o", "report.html")
    assert report.returncode == 0, report.stderr[-3000:]
    css = (ROOT / "trainguard" / "report" / "assets" / "report.css").read_text().strip().splitlines()[0]
    assert css in (installed.work / "report.html").read_text()         # the assets are inlined from the wheel

    replay = installed.run("trainguard", "replay", "demo", "--json")
    assert replay.returncode == 0, replay.stderr[-3000:]

    package = Path(where.stdout.strip()).parent
    before = sorted(p.name for p in (package / "alerts").iterdir())
    refused = installed.run("trainguard", "alerts", "render")
    assert refused.returncode == 2 and "--out" in refused.stderr
    assert installed.run("trainguard", "alerts", "render", "--out", "rules").returncode == 0
    assert installed.run("trainguard", "dashboards", "render", "--out", "boards").returncode == 0
    assert installed.run("trainguard", "dashboards", "render").returncode == 2
    assert sorted(p.name for p in (package / "alerts").iterdir()) == before
    assert list((installed.work / "rules").glob("*.rules.yml")) and list((installed.work / "boards").glob("*.json"))

    require_binary("promtool")
    require_binary("amtool")
    alerts = installed.run("trainguard", "alerts", "test")
    assert alerts.returncode == 0, alerts.stdout[-3000:] + alerts.stderr[-3000:]
    assert "promtool test rules: ok" in alerts.stdout
