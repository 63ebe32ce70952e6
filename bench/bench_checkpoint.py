"""Verified checkpoints against plain torch.save / torch.load, side by side, on the same state, in one run.

    .venv/bin/python bench/bench_checkpoint.py                  # GPT ~51M params + AdamW, median of 3
    .venv/bin/python bench/bench_checkpoint.py --repeat 5 --write-docs

The state is what the trainer checkpoints: the bundled GPT (8 layers, 512 wide, GPT-2 vocabulary, tied
embeddings: ~51M parameters) after one AdamW step, its scheduler, data position and RNG states, on CPU
(~620 MB). Each repeat measures, in this order, with `os.sync()` before each so no one pays for another's
writeback:

  peer      raw torch.save          model.pt, optim.pt, extra.pt, no hashing, no fsync
  peer      raw torch.save + fsync  the same, each file and the directory fsynced (durable, like ours)
  floor     SHA-256 in memory       hashlib.sha256 over the same bytes already in memory: what hashing
                                    costs at the least, on one core
  floor     SHA-256, every CPU      the same bytes cut in one piece per CPU, hashed on that many threads
                                    at once: what hashing costs at the least on this host (no ordering of
                                    the work can make a verified save cheaper than this)
  ours      verified save (sync)    CheckpointManager.save: hashed while written, fsynced, signed, renamed
  ours      async save              time save() blocks (copy off the device) / time until durable
  peer      raw load + hash         torch.load(weights_only=True) of each file + SHA-256 of each file
  ours      verified restore        CheckpointManager.load_latest(): verify signature, read+hash+load

Targets (issue 3): verified save <= 1.25x raw torch.save; async blocking <= 10% of a sync save.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from trainguard.trainer.checkpoint import CheckpointManager, store
from trainguard.trainer.config import ModelConfig
from trainguard.trainer.model import GPT

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Checkpoints"


def make_state() -> dict:
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=8, n_head=8, n_embd=512, block_size=1024, vocab_size=50304))
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 1.0)
    idx = torch.randint(0, 50304, (1, 64))
    model(idx, idx)[1].backward()
    optim.step()
    sched.step()
    return {"model": model.state_dict(), "optim": optim.state_dict(), "sched": sched.state_dict(),
            "data": {"position": [123456]}, "rng": {"torch": torch.get_rng_state(),
                                                     "python": list(random.getstate()[1])}}


def timed(fn) -> float:
    os.sync()
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def raw_save(state: dict, directory: Path, fsync: bool) -> None:
    directory.mkdir()
    extra = {k: v for k, v in state.items() if k not in ("model", "optim")}
    for name, obj in (("model.pt", state["model"]), ("optim.pt", state["optim"]), ("extra.pt", extra)):
        torch.save(obj, directory / name)
        if fsync:
            with open(directory / name, "rb") as handle:
                os.fsync(handle.fileno())
    if fsync:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        os.fsync(fd)
        os.close(fd)


def raw_load_and_hash(directory: Path) -> dict:
    loaded = {}
    for name in ("model.pt", "optim.pt", "extra.pt"):
        with open(directory / name, "rb") as handle:
            hashlib.file_digest(handle, "sha256")
        loaded[name] = torch.load(directory / name, map_location="cpu", weights_only=True)
    return loaded


def pieces_per_cpu(contents: list[bytes]) -> list[bytes]:
    """The bytes of `contents` cut into one equal piece per CPU."""
    whole = b"".join(contents)
    size = -(-len(whole) // store.CPUS)
    return [whole[i * size:(i + 1) * size] for i in range(store.CPUS)]


def hash_at_once(pieces: list[bytes]) -> None:
    """SHA-256 of every piece, all at once on a thread each (hashlib releases the GIL): the host's hashing
    throughput, not a digest anyone uses."""
    with ThreadPoolExecutor(max_workers=len(pieces)) as pool:
        list(pool.map(lambda piece: hashlib.sha256(piece).digest(), pieces))


def run(repeat: int, base: Path, key_file: Path) -> tuple[dict[str, list[float]], int]:
    state = make_state()
    times: dict[str, list[float]] = {k: [] for k in ("raw", "raw_fsync", "hash_floor", "hash_all_cpus", "verified",
                                                       "async_blocking", "async_total", "raw_load_hash",
                                                       "verified_restore")}
    sync = CheckpointManager(base / "sync", key_file=key_file, keep_last=100, log=_silent())
    async_ = CheckpointManager(base / "async", key_file=key_file, keep_last=100, async_save=True, log=_silent())
    size = 0
    for i in range(repeat):
        raw_dir, fsync_dir = base / f"raw-{i}", base / f"raw-fsync-{i}"
        times["raw"].append(timed(lambda: raw_save(state, raw_dir, fsync=False)))
        times["raw_fsync"].append(timed(lambda: raw_save(state, fsync_dir, fsync=True)))
        contents = [(fsync_dir / name).read_bytes() for name in ("model.pt", "optim.pt", "extra.pt")]
        times["hash_floor"].append(timed(lambda: [hashlib.sha256(data).digest() for data in contents]))
        pieces = pieces_per_cpu(contents)
        del contents
        times["hash_all_cpus"].append(timed(lambda: hash_at_once(pieces)))
        del pieces
        handle = None

        def verified():
            nonlocal handle
            handle = sync.save(i, state, stable=True)

        times["verified"].append(timed(verified))
        size = handle.bytes
        blocking = timed(lambda: async_.save(i, state, stable=True))
        os_wait = time.perf_counter()
        async_.wait()
        times["async_blocking"].append(blocking)
        times["async_total"].append(blocking + time.perf_counter() - os_wait)
        times["raw_load_hash"].append(timed(lambda: raw_load_and_hash(fsync_dir)))
        times["verified_restore"].append(timed(lambda: sync.load_latest()))
        for path in (raw_dir, fsync_dir, base / "sync" / "checkpoints" / f"step_{i - 1}",
                     base / "async" / "checkpoints" / f"step_{i - 1}"):
            shutil.rmtree(path, ignore_errors=True)  # disk space, outside the timings
    return times, size


def _silent():
    import logging

    import structlog

    return structlog.make_filtering_bound_logger(logging.CRITICAL)(structlog.PrintLogger(), [], {})


def report(times: dict[str, list[float]], size: int, repeat: int, command: str) -> str:
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [
        ("raw torch.save (peer)", med["raw"], "1.00x"),
        ("raw torch.save + fsync (peer)", med["raw_fsync"], f"{med['raw_fsync'] / med['raw']:.2f}x"),
        ("SHA-256 of the same bytes in memory (floor)", med["hash_floor"],
         f"{med['hash_floor'] / med['raw']:.2f}x"),
        (f"SHA-256 of the same bytes on all {store.CPUS} CPUs at once (floor)", med["hash_all_cpus"],
         f"{med['hash_all_cpus'] / med['raw']:.2f}x"),
        ("verified save, sync", med["verified"], f"{med['verified'] / med['raw']:.2f}x"),
        ("async save: blocking", med["async_blocking"], f"{med['async_blocking'] / med['verified']:.1%} of sync"),
        ("async save: until durable", med["async_total"], f"{med['async_total'] / med['raw']:.2f}x"),
        ("raw torch.load + SHA-256 (peer)", med["raw_load_hash"], "1.00x"),
        ("verified restore (load_latest)", med["verified_restore"],
         f"{med['verified_restore'] / med['raw_load_hash']:.2f}x"),
    ]
    save_ratio = med["verified"] / med["raw"]
    blocking_ratio = med["async_blocking"] / med["verified"]
    host = (f"{platform.node()}, {os.cpu_count()} CPUs (load average {os.getloadavg()[1]:.1f} at the end), "
            f"torch {torch.__version__}, Python {platform.python_version()}")
    lines = [SECTION, "",
             f"`{command}` — GPT ~51M parameters + AdamW state, {size / 2**20:.0f} MiB per checkpoint, on CPU, "
             f"median of {repeat}; {host}; {time.strftime('%Y-%m-%d', time.gmtime())}. Every measurement starts "
             "after `os.sync()`; files land in the page cache and the fsync goes to the disk. The host is shared "
             "with other work, so absolute times move between runs; the ratios are the figures to read.", "",
             "| operation | seconds (median) | ratio |", "|---|---:|---:|",
             *[f"| {name} | {seconds:.3f} | {ratio} |" for name, seconds, ratio in rows], "",
             f"- verified save at most 1.25x raw torch.save: {'met' if save_ratio <= 1.25 else 'NOT met'} "
             f"({save_ratio:.2f}x; against raw torch.save + fsync, the durable peer: "
             f"{med['verified'] / med['raw_fsync']:.2f}x)",
             f"- async blocking at most 10% of a sync save: {'met' if blocking_ratio <= 0.10 else 'NOT met'} "
             f"({blocking_ratio:.1%})",
             f"- restore of the latest verified checkpoint: {med['verified_restore'] / med['raw_load_hash']:.2f}x "
             "raw torch.load plus hashing (each file opened once: hashed, then loaded through the same "
             "descriptor)",
             f"- where a verified save's time goes: the durable peer (save + fsync) {med['raw_fsync']:.3f} s plus "
             f"SHA-256 of every byte {med['hash_floor']:.3f} s is {med['raw_fsync'] + med['hash_floor']:.3f} s "
             f"done one after the other; measured {med['verified']:.3f} s. A sync save writes its files at once, "
             "each with a hash thread beside its writer; an async save writes them in turn (hash threads only "
             f"with 4+ CPUs: here {'yes' if store.PARALLEL_HASH else 'no'}), and its blocking part is a copy of "
             "the state into reused host buffers (memory bandwidth).",
             f"- the hashing floor of this host: SHA-256 of every byte on all {store.CPUS} CPUs at once takes "
             f"{med['hash_all_cpus']:.3f} s, {med['hash_floor'] / med['hash_all_cpus']:.2f}x faster than on one "
             f"({med['hash_all_cpus'] / med['raw']:.2f}x a raw torch.save).",
             both_targets(med),
             "- all runs: " + ", ".join(f"{k} {' / '.join(f'{s:.3f}' for s in v)}" for k, v in times.items()), ""]
    return "\n".join(lines)


def both_targets(med: dict[str, float]) -> str:
    """Whether one sync save time can meet both targets here: the async target asks a sync save of at
    least 10x the async blocking time (a copy of the state, bounded by memory bandwidth on a CPU host),
    the save target at most 1.25x a raw torch.save."""
    at_least, at_most = 10 * med["async_blocking"], 1.25 * med["raw"]
    verdict = (f"a sync save between {at_least:.3f} s and {at_most:.3f} s would meet both" if at_least <= at_most
               else "no sync save time meets both on this host (on a GPU host the blocking part is the "
                    "device-to-host copy, and a sync save includes that copy too)")
    return (f"- both targets at once: async blocking <= 10% needs a sync save of at least 10 x "
            f"{med['async_blocking']:.3f} = {at_least:.3f} s; verified save <= 1.25x raw needs at most "
            f"1.25 x {med['raw']:.3f} = {at_most:.3f} s: {verdict}.")


def write_docs(section: str) -> Path:
    path = ROOT / "docs" / "benchmarks.md"
    text = path.read_text() if path.exists() else "# Benchmarks\n\n"
    start = text.find(SECTION + "\n")
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + 1)
        text = text[:start] + section.rstrip("\n") + "\n" + ("\n" + text[end + 1:] if end >= 0 else "")
    path.write_text(text if text.endswith("\n") else text + "\n")
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", type=Path, help="where to write (default: a temporary directory)")
    parser.add_argument("--write-docs", action="store_true",
                        help=f"replace the '{SECTION}' section of docs/benchmarks.md")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="trainguard-bench-ckpt-", dir=args.dir))
    try:
        times, size = run(args.repeat, base, base / "checkpoint.key")
    finally:
        shutil.rmtree(base, ignore_errors=True)
    command = "python bench/bench_checkpoint.py" + (f" --repeat {args.repeat}" if args.repeat != 3 else "")
    section = report(times, size, args.repeat, command)
    print(section)
    if args.write_docs:
        print(f"written to {write_docs(section)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
