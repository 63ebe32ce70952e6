"""A healthy 2,000-step run with replica checks: raises nothing. A long form of
tests/sdc/test_sdc_train.py::test_a_healthy_run_raises_nothing (400 steps there), the same run and checks.

    .venv/bin/python bench/sdc_healthy.py                 # 2,000 steps, 2 ranks (about 40 s on 2 quiet cores)
    .venv/bin/python bench/sdc_healthy.py --steps 5000

Exit status 0 when nothing was raised, 1 (listing every false alarm) otherwise.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.sdc import healthy  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=healthy.ISSUE_STEPS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tg-sdc-healthy-") as tmp:
        began = time.monotonic()
        run = healthy.train(Path(tmp), args.steps)
        wrong = healthy.false_alarms(run, args.steps)
        print(f"{args.steps} steps, 2 ranks, a replica check every {healthy.EVERY}: "
              f"{len(wrong)} false alarms in {time.monotonic() - began:.0f} s")
        for line in wrong:
            print("  " + line)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
