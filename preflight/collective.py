"""Two-rank collective on this node: gloo on CPU, NCCL when two GPUs are visible, within a timeout.

Two processes (torch.multiprocessing, spawn) join a process group through a file store in a temporary
directory (no port to race for), all-reduce a tensor several times and check the sum, then meet at a
barrier. The parent waits at most the timeout: a rank that hangs (a broken NCCL transport, a firewall
between local interfaces) fails the check instead of hanging preflight, and both ranks are killed.
"""

from __future__ import annotations

import queue as queue_mod
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from trainguard.runtime.preflight_result import FAIL, PASS, CheckResult

WORLD = 2
ELEMENTS = 1 << 20          # 4 MiB of float32 per all-reduce
ITERATIONS = 5


def _rank_main(rank: int, backend: str, store: str, timeout: float, results) -> None:
    """One rank: join, all-reduce ITERATIONS times, check the sum, barrier; report to the parent."""
    try:
        import torch
        import torch.distributed as dist

        dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=WORLD,
                                timeout=timedelta(seconds=timeout))
        device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(device)
        tensor = torch.empty(ELEMENTS, device=device)
        began = time.perf_counter()
        for _ in range(ITERATIONS):
            tensor.fill_(rank + 1.0)
            dist.all_reduce(tensor)
        if backend == "nccl":
            torch.cuda.synchronize(device)
        seconds = (time.perf_counter() - began) / ITERATIONS
        expected = WORLD * (WORLD + 1) / 2
        wrong = (tensor != expected).sum().item()
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, None if wrong == 0 else f"{wrong} elements != {expected}", seconds))
    except Exception as exc:
        results.put((rank, f"{type(exc).__name__}: {exc}", None))


def pick_backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= WORLD \
        and torch.distributed.is_nccl_available() else "gloo"


def check_collective(timeout: float, backend: str | None = None) -> CheckResult:
    import torch.multiprocessing as mp

    backend = backend or pick_backend()
    context = mp.get_context("spawn")
    results = context.Queue()
    details = {"backend": backend, "world_size": WORLD, "timeout_seconds": timeout}
    with tempfile.TemporaryDirectory(prefix="trainguard-preflight-") as tmp:
        store = str(Path(tmp) / "store")
        ranks = [context.Process(target=_rank_main, args=(r, backend, store, timeout, results), daemon=True)
                 for r in range(WORLD)]
        began = time.monotonic()
        for process in ranks:
            process.start()
        reports = {}
        try:
            while len(reports) < WORLD:
                left = timeout - (time.monotonic() - began)
                if left <= 0:
                    break
                try:
                    rank, error, seconds = results.get(timeout=min(left, 1.0))
                    reports[rank] = (error, seconds)
                except queue_mod.Empty:
                    if any(p.exitcode not in (None, 0) for p in ranks):
                        break   # a rank died without a word (killed, segfault): no point waiting
        finally:
            exit_codes = {r: p.exitcode for r, p in enumerate(ranks)}   # as they were at the verdict
            _stop(ranks, grace=10.0 if len(reports) == WORLD else 0.0)
    details["seconds"] = round(time.monotonic() - began, 3)
    return _verdict(reports, exit_codes, backend, timeout, details)


def _stop(ranks: list, grace: float) -> None:
    """Let ranks that reported exit on their own (within `grace`); kill the rest, then reap them all."""
    for process in ranks:
        process.join(timeout=grace)
        if process.is_alive():
            process.kill()
    for process in ranks:
        process.join()


def _verdict(reports: dict, exit_codes: dict, backend: str, timeout: float, details: dict) -> CheckResult:
    silent = [r for r in range(WORLD) if r not in reports]
    if silent:
        codes = {r: exit_codes[r] for r in silent}
        how = "did not finish" if all(c is None or c < 0 for c in codes.values()) else "died"
        return CheckResult("collective", FAIL, f"{backend} all-reduce over {WORLD} ranks: rank(s) "
                                               f"{', '.join(map(str, silent))} {how} within {timeout:g} s "
                                               f"(exit codes {codes})", details)
    errors = {r: e for r, (e, _) in reports.items() if e}
    if errors:
        text = "; ".join(f"rank {r}: {e}" for r, e in sorted(errors.items()))
        return CheckResult("collective", FAIL, f"{backend} all-reduce over {WORLD} ranks failed: {text}", details)
    per_call = max(s for _, s in reports.values())
    details["all_reduce_seconds"] = round(per_call, 6)
    details["algbw_bytes_per_second"] = round(ELEMENTS * 4 / per_call) if per_call > 0 else None
    return CheckResult("collective", PASS, f"{backend} all-reduce over {WORLD} ranks correct, "
                                           f"{per_call * 1e3:.1f} ms per 4 MiB", details)
