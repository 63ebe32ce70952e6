"""Bit-exact fingerprints of tensors, computed on their device: the replica check's measurement.

A fingerprint reads each tensor's *bits*, not its values: the tensor is viewed as signed integers of its
own width (float32 -> int32, bfloat16/float16 -> int16, float64 -> int64, 1-byte types -> int8), widened
to int64, multiplied by a position-dependent odd weight and summed, all modulo 2^64 (int64 arithmetic
wraps):

    fingerprint(t) = sum_i  bits(t[i]) * w_i                    (mod 2^64),  w_i odd
    fingerprint(tensors) = sum_k  fingerprint(t_k) * m_k        (mod 2^64),  m_k odd

Why any single flipped bit changes it: flipping bit b of element i changes bits(t[i]) by +-2^b
(b < 64; the sign bit of an int32 view too, since the value is sign-extended), so the sum changes by
+-2^b * w_i * m_k. An odd number is invertible modulo 2^64, so that product is 0 mod 2^64 only if 2^b is,
which it is not for b < 64. NaNs with different payloads, -0.0 and +0.0 all differ, as they must:
replicas that train in lockstep are identical to the bit.

The weights are w_i = (i * GOLDEN + SALT) | 1 (a multiplicative hash of the position), made once per
device for the largest tensor and sliced; m_k likewise from the tensor's index. Nothing is copied to the
host but the final int64s, and only when the caller asks (`.tolist()` after the all-gather).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from trainguard.decide.replica import hex64  # noqa: F401  (re-exported: how fingerprints are spelled)

GOLDEN = -7046029254386353131     # 0x9E3779B97F4A7C15 as a signed int64: Fibonacci hashing's multiplier
SALT = 0x632BE59BD9B4E019          # fits in int64; any odd-making offset would do
_INT_OF_WIDTH = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def _weights(count: int, device: torch.device, cache: dict) -> torch.Tensor:
    """The first `count` odd position weights on `device` (grown and kept in `cache`)."""
    have = cache.get(device)
    if have is None or have.numel() < count:
        positions = torch.arange(count, dtype=torch.int64, device=device)
        have = (positions * GOLDEN + SALT) | 1
        cache[device] = have
    return have[:count]


def as_bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as signed integers of their own width, flat (a view when contiguous)."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(_INT_OF_WIDTH[flat.element_size()])


class Fingerprinter:
    """Fingerprints of a fixed list of tensors (a model's parameters, or their gradients).

    Keeps the weight vector on the device between calls, so a check allocates only its temporaries.
    `chunk` bounds those temporaries (int64: 16 bytes per element in flight) for very large tensors.
    """

    def __init__(self, chunk: int = 1 << 24):
        self.chunk = chunk
        self._cache: dict = {}

    def tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """One tensor's fingerprint: a 0-d int64 tensor on its device."""
        bits = as_bits(tensor)
        weights = _weights(min(bits.numel(), self.chunk), bits.device, self._cache)
        total = torch.zeros((), dtype=torch.int64, device=bits.device)
        for start in range(0, bits.numel(), self.chunk):
            part = bits[start:start + self.chunk].to(torch.int64)
            # chunks of one tensor get distinct weights: the chunk index is folded in as an odd factor
            total += (part * weights[:part.numel()]).sum() * (2 * (start // self.chunk) + 1)
        return total

    def many(self, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """Per-tensor fingerprints, int64 of shape [len(tensors)]; a missing tensor (None) counts as 0."""
        device = next((t.device for t in tensors if t is not None), torch.device("cpu"))
        values = [self.tensor(t) if t is not None else torch.zeros((), dtype=torch.int64, device=device)
                  for t in tensors]
        return torch.stack(values) if values else torch.zeros(0, dtype=torch.int64, device=device)

    def combine(self, per_tensor: torch.Tensor) -> torch.Tensor:
        """One int64 for all tensors: each weighted by an odd factor of its index (order matters)."""
        factors = _weights(per_tensor.numel(), per_tensor.device, self._cache)
        return (per_tensor * factors).sum()

    def fingerprint(self, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
        return self.combine(self.many(tensors))


def gradients(params: Iterable[torch.nn.Parameter]) -> list[torch.Tensor | None]:
    return [p.grad for p in params]


def gather(values: torch.Tensor, world_size: int) -> torch.Tensor:
    """Every rank's `values` (a small int64 vector), in one all_gather: shape [world_size, len(values)]."""
    if world_size == 1:
        return values.reshape(1, -1)
    flat = values.reshape(-1).contiguous()
    out = torch.empty(world_size * flat.numel(), dtype=flat.dtype, device=flat.device)   # gloo: flat
    dist.all_gather_into_tensor(out, flat)
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
