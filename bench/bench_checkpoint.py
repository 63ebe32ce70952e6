"""Verified checkpoints (format /2, DCP underneath) against durable peers, side by side, in one run.

    .venv/bin/python bench/bench_checkpoint.py                  # tiny GPT + AdamW, median of 3
    .venv/bin/python bench/bench_checkpoint.py --n-embd 512 --n-layer 8 --repeat 5

The state is what the trainer checkpoints: a GPT (default 4 layers, 256 wide, byte vocabulary; small on
purpose: the host's 2 cores are shared) after one AdamW step, on CPU. One process, no process group.
`os.sync()` before every measurement so no one pays for another's writeback. Rows:

  peer   torch.save + fsync        model.pt and optim.pt, each fsynced, the directory too (durable)
  peer   DCP save                  torch.distributed.checkpoint.save, FileSystemWriter(sync_files=True)
  peer   DCP save, then SHA-256    the same, then every file read back and hashed (hashing *beside* DCP)
  ours   verified save (sync)      CheckpointManager.save: DCP with every byte hashed as it is written,
                                   signed manifest, fsync, rename (hashing *while* writing)
  floor  copy of the state         one copy_ of every tensor into preallocated host buffers
  peer   DCP async_save, blocking  the time async_save() holds the caller (its staging)
  ours   async save, blocking      CheckpointManager.save(async_save=True): time save() holds the caller
                                   (a manager's later saves, as in training: its first allocates the buffers)
  peer   DCP load + SHA-256        every file hashed, then torch.distributed.checkpoint.load into the model
  ours   verified restore          CheckpointManager.load_latest(into=...): signature, every hash, safe load
  peer   DCP load, resharded       a checkpoint saved by 2 FSDP2 ranks (torchrun, gloo) loaded into one plain
                                   process by torch.distributed.checkpoint.load (and + SHA-256 of its files)
  ours   restore, resharded        CheckpointManager.load_latest(into=...) of the same state saved by 2 ranks
  size   none / lossless / fp16-zlib   bytes of the tensors' files; lossless checked bit-exact
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
warnings.filterwarnings("ignore")

from trainguard.runtime.checkpoint import CheckpointManager, archive  # noqa: E402
from trainguard.trainer.config import ModelConfig  # noqa: E402
from trainguard.trainer.model import GPT  # noqa: E402


def training_state(n_layer: int, n_embd: int) -> dict:
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=n_layer, n_head=4, n_embd=n_embd, block_size=64, vocab_size=256))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, 256, (2, 64))
    model(idx, idx)[1].backward()
    optim.step()
    return {"model": model.state_dict(), "optim": optim.state_dict()}


def timed(run) -> float:
    os.sync()
    began = time.perf_counter()
    run()
    return time.perf_counter() - began


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_save_fsync(state: dict, folder: Path) -> None:
    folder.mkdir()
    for name in ("model", "optim"):
        with open(folder / f"{name}.pt", "wb") as handle:
            torch.save(state[name], handle)
            handle.flush()
            os.fsync(handle.fileno())
    fsync_path(folder)


def dcp_save(state: dict, folder: Path, hash_after: bool = False) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder, sync_files=True), no_dist=True)
    if hash_after:
        hash_files(folder)


def hash_files(folder: Path) -> None:
    for path in sorted(folder.iterdir()):
        with open(path, "rb") as handle:
            hashlib.file_digest(handle, "sha256")


def copy_floor(state: dict, buffers: list) -> None:
    tensors = [t for t in _tensors(state)]
    if not buffers:
        buffers.extend(torch.empty_like(t) for t in tensors)
    for buffer, tensor in zip(buffers, tensors):
        buffer.copy_(tensor)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def dcp_async_blocking(state: dict, folder: Path) -> float:
    import torch.distributed.checkpoint as dcp

    began = time.perf_counter()
    future = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(folder, sync_files=True), no_dist=True)
    blocked = time.perf_counter() - began
    getattr(future, "upload_completion", future).result()
    return blocked


def dcp_load_hashed(state: dict, folder: Path) -> None:
    import torch.distributed.checkpoint as dcp

    hash_files(folder)
    dcp.load(state, storage_reader=dcp.FileSystemReader(folder), no_dist=True)


def fsdp_state(n_layer: int, n_embd: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The bench's GPT and AdamW after one step (wrapped with FSDP2 when a process group is up)."""
    import torch.distributed as dist

    from trainguard.trainer import parallel

    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=n_layer, n_head=4, n_embd=n_embd, block_size=64, vocab_size=256))
    world = dist.get_world_size() if dist.is_initialized() else 1
    model = parallel.wrap(model, parallel.FSDP2, world, torch.device("cpu"))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, 256, (2, 64))
    model(idx, idx)[1].backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    return model, optim


def save_sharded(folder: Path, n_layer: int, n_embd: int) -> None:
    """(Under torchrun, every rank.) The FSDP2 state saved by CheckpointManager and by plain DCP."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from trainguard.trainer import parallel

    dist.init_process_group("gloo")
    model, optim = fsdp_state(n_layer, n_embd)
    state = parallel.train_state(model, optim)
    CheckpointManager(folder / "ours", distributed=True, keep_last=1).save(1, state, stable=True)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder / "dcp", sync_files=True))
    dist.barrier()
    dist.destroy_process_group()


def resharded(args: argparse.Namespace, root: Path, results: dict[str, list[float]]) -> None:
    """2 FSDP2 ranks' checkpoint into 1 process: ours against DCP's own resharding load."""
    import subprocess

    import torch.distributed.checkpoint as dcp

    from trainguard.trainer import parallel

    folder = root / "sharded"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                    __file__, "--save-sharded", str(folder), "--n-layer", str(args.n_layer), "--n-embd",
                    str(args.n_embd)], check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    model, optim = fsdp_state(args.n_layer, args.n_embd)
    for _ in range(args.repeat):
        target = parallel.train_state(model, optim)
        results.setdefault("DCP load, resharded 2->1", []).append(timed(
            lambda: dcp.load(target, storage_reader=dcp.FileSystemReader(folder / "dcp"), no_dist=True)))
        results.setdefault("DCP load resharded + SHA-256", []).append(timed(
            lambda: dcp_load_hashed(target, folder / "dcp")))
        results.setdefault("restore resharded 2->1 (ours)", []).append(timed(
            lambda: CheckpointManager(folder / "ours").load_latest(into=target)))


def tensor_file_bytes(step_dir: Path) -> int:
    return sum(p.stat().st_size for p in step_dir.iterdir() if p.name.endswith(".distcp"))


def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    state = training_state(args.n_layer, args.n_embd)
    results: dict[str, list[float]] = {}
    buffers: list = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        os.environ["TRAINGUARD_CHECKPOINT_KEY"] = str(root / "key")
        for i in range(args.repeat):
            rows = {
                "torch.save + fsync": lambda: torch_save_fsync(state, root / f"ts{i}"),
                "DCP save": lambda: dcp_save(state, root / f"dcp{i}"),
                "DCP save, then SHA-256": lambda: dcp_save(state, root / f"dcph{i}", hash_after=True),
                "verified save (sync)": lambda: CheckpointManager(root / f"ours{i}", keep_last=1)
                .save(1, state, stable=True),
                "copy of the state (floor)": lambda: copy_floor(state, buffers),
            }
            for name, run in rows.items():
                results.setdefault(name, []).append(timed(run))
            os.sync()
            results.setdefault("DCP async_save, blocking", []).append(dcp_async_blocking(state, root / f"dcpa{i}"))
            if i == 0:   # one manager for the run, as a trainer has: its staging buffers are kept
                manager = CheckpointManager(root / "async", async_save=True, keep_last=1)
                manager.save(1, state, stable=True)
                manager.wait()
            os.sync()
            handle = manager.save(2 + i, state, stable=True)
            manager.wait()
            results.setdefault("async save, blocking (ours)", []).append(handle.blocking_seconds)
            target = training_state(args.n_layer, args.n_embd)
            results.setdefault("DCP load + SHA-256", []).append(
                timed(lambda: dcp_load_hashed(target, root / f"dcp{i}")))
            results.setdefault("verified restore (ours)", []).append(
                timed(lambda: CheckpointManager(root / f"ours{i}").load_latest(into=target)))
        for mode in ("none", "lossless"):
            manager = CheckpointManager(root / f"size-{mode}", compress=mode)
            manager.save(1, state, stable=True)
            results[f"size {mode} (bytes)"] = [tensor_file_bytes(manager.root / "step_1")]
            if mode == "lossless":
                _, restored = manager.load_latest()
                exact = all(torch.equal(a, b) for a, b in zip(_tensors(state), _tensors(restored)))
                results["lossless bit-exact"] = [float(exact)]
        resharded(args, root, results)
        plain = CheckpointManager(root / "size-none")
        export = archive.export_checkpoint(plain, plain.latest_verified(), root / "export")
        results["size fp16-zlib (bytes)"] = [tensor_file_bytes(export.path)]
        results["fp16-zlib max abs error"] = [export.manifest["layout"]["max_abs_error"]]
    return results


def report(results: dict[str, list[float]], args: argparse.Namespace) -> str:
    med = {name: statistics.median(values) for name, values in results.items()}
    durable_peer = min(med["torch.save + fsync"], med["DCP save"])
    lines = [f"`.venv/bin/python bench/bench_checkpoint.py --n-layer {args.n_layer} --n-embd {args.n_embd} "
             f"--repeat {args.repeat}` — {time.strftime('%Y-%m-%d')}; {os.cpu_count()} CPUs shared, "
             f"load average {os.getloadavg()[0]:.1f}; Python {platform.python_version()}, torch {torch.__version__}",
             "", "| figure | ours | peer | ratio | target |", "|---|---|---|---|---|"]

    def row(figure, ours, peer_name, target):
        peer = med[peer_name] if isinstance(peer_name, str) else peer_name
        lines.append(f"| {figure} | {med[ours]:.3f} s | {peer:.3f} s ({peer_name if isinstance(peer_name, str) else 'faster durable peer'}) "
                     f"| {med[ours] / peer:.2f} | {target} |")

    row("verified sync save", "verified save (sync)", durable_peer, "<= 1.0x the faster durable peer")
    row("verified sync save vs hashing beside DCP", "verified save (sync)", "DCP save, then SHA-256",
        "(measures which hashing)")
    row("async save blocked vs DCP", "async save, blocking (ours)", "DCP async_save, blocking", "<= 1.0x DCP's")
    row("async save blocked vs copy floor", "async save, blocking (ours)", "copy of the state (floor)",
        "<= 1.25x the floor")
    row("verified restore", "verified restore (ours)", "DCP load + SHA-256", "<= 1.1x")
    row("restore into another world size (2 -> 1)", "restore resharded 2->1 (ours)", "DCP load, resharded 2->1",
        "<= 1.1x")
    row("restore into another world size, vs DCP + SHA-256", "restore resharded 2->1 (ours)",
        "DCP load resharded + SHA-256", "(the hashing's share)")
    none = med["size none (bytes)"]
    lines += ["", f"sizes of the tensors' files: none {none / 2**20:.1f} MiB; lossless "
              f"{med['size lossless (bytes)'] / 2**20:.1f} MiB ({1 - med['size lossless (bytes)'] / none:.0%} smaller, "
              f"bit-exact: {bool(med['lossless bit-exact'])}); fp16-zlib export {med['size fp16-zlib (bytes)'] / 2**20:.1f}"
              f" MiB ({1 - med['size fp16-zlib (bytes)'] / none:.0%} smaller; the seed reports 78%), "
              f"max abs error {med['fp16-zlib max abs error']:.2g}",
              "", "raw medians (s): " + ", ".join(f"{k} {v:.3f}" for k, v in med.items() if "bytes" not in k
                                                   and "error" not in k and "exact" not in k)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    parser.add_argument("--save-sharded", type=Path, help=argparse.SUPPRESS)   # the torchrun ranks' part
    args = parser.parse_args()
    if args.save_sharded:
        save_sharded(args.save_sharded, args.n_layer, args.n_embd)
        return
    print(report(measure(args), args))


if __name__ == "__main__":
    main()
