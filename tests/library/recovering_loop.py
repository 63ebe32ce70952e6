"""One rank of docs/library.md's recoverable loop, run as the doc writes it (tests/library/test_library_recovery.py
starts two of these over gloo on loopback, as torchrun would: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

    python -m tests.library.recovering_loop RUN STEPS FAIL_AT POLICY OUT

OUT gets this process's pid and the model's final weights, for the test to compare the ranks."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "library.md"


def documented_loop():
    """The `train_recoverable` function of the doc's "Recovery" section, executed from the doc's own text."""
    block = next(b for b in re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S) if "def train_recoverable(" in b)
    namespace: dict = {}
    exec(compile(block, str(DOC), "exec"), namespace)
    return namespace["train_recoverable"], namespace


def main(argv: list[str]) -> int:
    run_dir, steps, fail_at, policy, out = argv
    train, namespace = documented_loop()
    weights = {}
    real_finish = namespace["Protector"].finish

    def finish(protector):            # the weights the run ends with, before the group is gone
        weights.update({name: value.tolist() for name, value in protector.states["model"].state_dict().items()})
        real_finish(protector)
    namespace["Protector"].finish = finish
    train(run_dir, steps=int(steps), fail_at=(int(fail_at),), policy=policy)
    Path(out).write_text(json.dumps({"pid": os.getpid(), "weights": weights}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
