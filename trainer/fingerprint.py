"""Bit-exact fingerprints of tensors, computed on their device: the replica check's measurement.

A fingerprint reads each tensor's *bits*, not its values. The tensor's bytes are read as 32-bit words
(float32 one element a word, bfloat16/float16 two, float64 half; a tensor whose byte count is not a
multiple of 4 is read in its own width, sign-extended to 32 bits), multiplied by position-dependent odd
weights and summed, modulo 2^32; the tensors' fingerprints are then combined modulo 2^64:

    fingerprint(t) = sum_i  word_i(t) * w_i                     (mod 2^32),  w_i odd
    fingerprint(tensors) = sum_k  fingerprint(t_k) * m_k        (mod 2^64),  m_k odd

Why any single flipped bit changes it: flipping one bit b of a tensor flips bit b (b < 32) of one word
(sign-extended: its value changes by +-2^b either way), so the sum changes by +-2^b * w_i. An odd number
is invertible modulo 2^32, so that is 0 mod 2^32 only if 2^b is, and it is not for b < 32. Likewise the
combination: a per-tensor change d in (0, 2^32) times an odd m_k is not 0 mod 2^64. NaNs with different
payloads, -0.0 and +0.0 all differ, as they must: replicas that train in lockstep are identical to the bit.
Several flipped bits at once can cancel only by coincidence, about one chance in 2^32 per tensor.

On the CPU the sums are integer matrix-vector and dot products (int32, wrapping); on a GPU a wrapping
int32 multiply and an int64 sum, masked to 32 bits, which is the same number (Fingerprinter lays the
words out in rows). The weights are (i * GOLDEN + SALT) | 1, made once per device and sliced. Nothing
is copied to the host but the final int64s, and only when the caller asks (`.tolist()` after the gather).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from trainguard.decide.replica import hex64  # noqa: F401  (re-exported: how fingerprints are spelled)

GOLDEN = -7046029254386353131     # 0x9E3779B97F4A7C15 as a signed int64: Fibonacci hashing's multiplier
SALT = 0x632BE59BD9B4E019          # fits in int64; any offset would do, the | 1 makes the weights odd
LOW32 = 0xFFFFFFFF
_INT_OF_WIDTH = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def _weights(count: int, device: torch.device, cache: dict, dtype: torch.dtype) -> torch.Tensor:
    """The first `count` odd position weights on `device`, as `dtype` (grown and kept in `cache`)."""
    have = cache.get((device, dtype))
    if have is None or have.numel() < count:
        positions = torch.arange(count, dtype=torch.int64, device=device)
        have = ((positions * GOLDEN + SALT) | 1).to(dtype)   # the low bits of an odd number: still odd
        cache[(device, dtype)] = have
    return have[:count]


def as_bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as signed integers of their own width, flat (a view when contiguous)."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(_INT_OF_WIDTH[flat.element_size()])


def as_words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as int32 words: a view when its bytes divide into words, else widened."""
    bits = as_bits(tensor)
    if bits.numel() * bits.element_size() % 4 == 0:
        return bits.view(torch.int32)
    return bits.to(torch.int32)


class Fingerprinter:
    """Fingerprints of a list of tensors (a model's parameters, or their gradients).

    A tensor's words are laid out as rows of ROW words; each row is a dot product with the same ROW odd
    weights w (mod 2^32: one cache-resident weight vector, so the pass reads the tensor and nothing
    else), and the rows are combined with odd 64-bit weights v_j (mod 2^64):

        fingerprint(t) = sum_j  v_j * (sum_i word_{j,i} * w_i  mod 2^32)   (mod 2^64)

    The single-bit argument holds at each level (see the module docstring). Tensors smaller than `batch`
    words are concatenated on the device, in order, and fingerprinted as one: a few kernels per check
    rather than a few per bias and norm, which dominate a check's time on small models. Only small ones:
    the copy costs a fresh allocation, which on a loaded host cost more than the pass itself (bench_sdc:
    a 10.8 M-parameter model took 234 ms with every tensor under 2^20 words concatenated, 50 ms under 2^16).
    """

    ROW = 4096

    def __init__(self, batch: int = 1 << 16, chunk_rows: int = 1 << 12):
        self.batch, self.chunk_rows = batch, chunk_rows
        self._cache: dict = {}

    def words(self, words: torch.Tensor) -> torch.Tensor:
        """Fingerprint of a flat int32 tensor: a 0-d int64 tensor on its device."""
        n, row = words.numel(), self.ROW
        full = n - n % row
        w = _weights(min(n, row), words.device, self._cache, torch.int32)
        parts = [_row_sums(words[start:min(full, start + self.chunk_rows * row)].view(-1, row), w)
                 for start in range(0, full, self.chunk_rows * row)]
        if n > full:
            parts.append(_dot32(words[full:], w[:n - full]).reshape(1))
        rows = torch.cat(parts) if parts else torch.zeros(1, dtype=torch.int64, device=words.device)
        return (rows * _weights(rows.numel(), words.device, self._cache, torch.int64)).sum()

    def tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """One tensor's fingerprint: a 0-d int64 tensor on its device."""
        return self.words(as_words(tensor))

    def many(self, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """Per-tensor fingerprints, int64 of shape [len(tensors)]; a missing tensor (None) counts as 0.
        (Which tensor differs, on the mismatch path; a check itself uses `fingerprint`.)"""
        device = next((t.device for t in tensors if t is not None), torch.device("cpu"))
        values = [self.tensor(t) if t is not None else torch.zeros((), dtype=torch.int64, device=device)
                  for t in tensors]
        return torch.stack(values) if values else torch.zeros(0, dtype=torch.int64, device=device)

    def combine(self, per_part: torch.Tensor) -> torch.Tensor:
        """One int64 for several fingerprints: each weighted by an odd factor of its index (order matters)."""
        factors = _weights(per_part.numel(), per_part.device, self._cache, torch.int64)
        return (per_part * factors).sum()

    def fingerprint(self, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """All tensors in one int64 (a missing one, None, is skipped: its absence is the same everywhere)."""
        return self.combine(torch.stack([self.words(words) for words in self._groups(tensors)]))

    def _groups(self, tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        """The tensors' words: large ones as they are (views), runs of small ones concatenated."""
        groups, run, size = [], [], 0
        for tensor in tensors:
            if tensor is None:
                continue
            words = as_words(tensor)
            if words.numel() >= self.batch:
                groups.append(words)
                continue
            if size + words.numel() > self.batch and run:
                groups.append(torch.cat(run))
                run, size = [], 0
            run.append(words)
            size += words.numel()
        if run:
            groups.append(torch.cat(run))
        if not groups:
            groups.append(torch.zeros(1, dtype=torch.int32))
        return groups


def _row_sums(rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each row's dot product with `weights`, mod 2^32, as int64: a wrapping int32 matrix-vector product
    on the CPU; elsewhere a wrapping int32 product summed in int64 and masked to the same 32 bits."""
    if rows.device.type == "cpu":
        return torch.mv(rows, weights).to(torch.int64) & LOW32
    return (rows * weights).sum(dim=1, dtype=torch.int64) & LOW32


def _dot32(words: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum(words * weights) mod 2^32, as int64: one wrapping integer dot product on the CPU; on other
    devices (no integer dot) a wrapping int32 product summed in int64, masked to the same 32 bits."""
    if words.device.type == "cpu":
        return torch.dot(words, weights).to(torch.int64) & LOW32
    return (words * weights).sum(dtype=torch.int64) & LOW32


def gradients(params: Iterable[torch.nn.Parameter]) -> list[torch.Tensor | None]:
    return [p.grad for p in params]


def gather(values: torch.Tensor, world_size: int) -> torch.Tensor:
    """Every rank's `values` (a small int64 vector), in one all_gather: shape [world_size, len(values)]."""
    if world_size == 1:
        return values.reshape(1, -1)
    flat = values.reshape(-1).contiguous()
    out = torch.empty(world_size * flat.numel(), dtype=flat.dtype, device=flat.device)   # gloo: flat
    dist.all_gather_single(out, flat)
    return out.reshape(world_size, flat.numel())


def flip_bit(tensor: torch.Tensor, index: int, bit: int) -> None:
    """Flip bit `bit` of element `index` of `tensor`, in place on its device (fault injection)."""
    with torch.no_grad():
        bits = as_bits(tensor)
        if bits.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
            raise ValueError("flip_bit needs a contiguous tensor")
        width = bits.element_size() * 8
        if not 0 <= bit < width:
            raise ValueError(f"bit {bit} out of range for a {width}-bit element")
        mask = torch.tensor(1 << bit if bit < width - 1 else -(1 << bit), dtype=bits.dtype, device=bits.device)
        bits[index] ^= mask
