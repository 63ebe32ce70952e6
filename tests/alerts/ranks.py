"""Real rank processes for the restore tests: the stand-in rank (standin_rank.py) under real torchrun."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

STANDIN = str(Path(__file__).with_name("standin_rank.py"))
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]   # torchrun, by module (a copied venv's scripts point elsewhere)


class Ranks:
    """`start()` launches torchrun with `nproc` stand-in ranks and waits for their rank files."""

    def __init__(self):
        self.launchers: list[subprocess.Popen] = []

    def start(self, run_dir: Path, nproc: int = 1, *, max_restarts: int = 1, ignore_term: bool = False,
              rank_ids=None, hold_log: bool = False, launcher: list[str] | None = None) -> list[dict]:
        directory = Path(run_dir) / "control" / "ranks"
        before = {p.name: p.stat().st_mtime_ns for p in directory.glob("rank-*.json")} if directory.exists() else {}
        command = [*(launcher or [*TORCHRUN, "--standalone", f"--nproc-per-node={nproc}",
                                  f"--max-restarts={max_restarts}", "--monitor-interval=0.5"]),
                   STANDIN, "--run-dir", str(run_dir), *(["--ignore-term"] if ignore_term else []),
                   *(["--hold-log"] if hold_log else [])]
        launcher = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.launchers.append(launcher)
        return self.wait_registered(run_dir, nproc, before)

    def wait_registered(self, run_dir: Path, nproc: int, before: dict, timeout: float = 120) -> list[dict]:
        """The rank files of `nproc` ranks written since `before` (name -> mtime_ns)."""
        directory = Path(run_dir) / "control" / "ranks"
        deadline = time.time() + timeout
        while time.time() < deadline:
            fresh = [p for p in directory.glob("rank-*.json")
                     if before.get(p.name) != p.stat().st_mtime_ns] if directory.exists() else []
            if len(fresh) >= nproc:
                return [json.loads(p.read_text()) for p in sorted(fresh)]
            time.sleep(0.05)
        raise AssertionError(f"{nproc} ranks did not register in {timeout}s")

    def stop(self) -> None:
        for launcher in self.launchers:
            try:
                os.killpg(launcher.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            launcher.wait()


def rewrite(run_dir: Path, rank: int, **changes) -> dict:
    """Change fields of a rank file, as someone who can write the run directory could."""
    path = Path(run_dir) / "control" / "ranks" / f"rank-{rank}.json"
    info = {**json.loads(path.read_text()), **changes}
    path.write_text(json.dumps(info))
    return info


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):    # reaped between the signal and the read (ESRCH)
        return False
