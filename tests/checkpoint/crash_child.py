"""A training process that gets SIGKILLed in the middle of a checkpoint (driven by test_checkpoint_crash).

    crash_child.py RUN_DIR KEY_FILE POINT

Saves step_1, then starts saving step_2 and stops at POINT, prints PAUSED and waits to be killed:
  write     part-way through writing the shard __0_0.distcp (some megabytes on disk)
  manifest  every file and the manifest written and fsynced, just before the rename
  async     like `write`, on the async worker thread while the main thread keeps training
The pause wraps the real functions; everything up to it runs the real code.
"""

from __future__ import annotations

import sys
import threading
import time

import torch

from trainguard.runtime.checkpoint import CheckpointManager, sharded, store


def small_state() -> dict:
    torch.manual_seed(0)
    return {"model": {"w": torch.randn(1000)}, "data": {"position": 1}}


def big_state() -> dict:
    torch.manual_seed(1)
    return {"model": {f"w{i}": torch.randn(1 << 20) for i in range(8)}, "data": {"position": 2}}  # 32 MiB


def pause(message: str = "PAUSED") -> None:
    print(message, flush=True)
    threading.Event().wait(120)


def main() -> None:
    run_dir, key_file, point = sys.argv[1:4]
    manager = CheckpointManager(run_dir, key_file=key_file, async_save=point == "async")
    manager.save(1, small_state(), stable=True)
    manager.wait()
    if point in ("write", "async"):
        real_write = sharded._WrittenStream.write

        def write_then_pause(self, data):
            written = real_write(self, data)
            if self.tell() >= 8 << 20:
                pause()
            return written

        sharded._WrittenStream.write = write_then_pause
    elif point == "manifest":
        real_publish = store.publish
        store.publish = lambda tmp, final: (pause(), real_publish(tmp, final))
    manager.save(2, big_state(), stable=False)
    while True:  # async: "training" goes on while the worker writes
        time.sleep(0.01)


if __name__ == "__main__":
    main()
