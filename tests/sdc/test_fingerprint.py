"""The fingerprint is bit-exact: every single-bit flip of a tensor changes it (trainer/fingerprint.py)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.trainer import fingerprint as fp

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def random_tensor(seed: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(numel, generator=generator) * 3).to(dtype)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), numel=st.integers(1, 48), dtype=st.sampled_from(DTYPES))
def test_every_single_bit_flip_changes_the_fingerprint(seed, numel, dtype):
    tensor = random_tensor(seed, numel, dtype)
    prints = fp.Fingerprinter()
    before = int(prints.fingerprint([tensor]))
    width = tensor.element_size() * 8
    bits = fp.as_bits(tensor)
    # every (element, bit) pair at once: one flipped copy per pair, fingerprinted as a tensor each
    flipped = bits.repeat(numel * width, 1)
    rows = torch.arange(numel * width)
    masks = torch.tensor([(1 << b) if b < width - 1 else -(1 << b) for b in range(width)], dtype=bits.dtype)
    flipped[rows, rows // width] ^= masks.repeat(numel)
    changed = [int(prints.fingerprint([row.view(dtype)])) != before for row in flipped]
    assert all(changed), [divmod(i, width) for i, c in enumerate(changed) if not c]


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from(DTYPES), data=st.data())
def test_flip_bit_in_place_changes_one_tensor_of_many(seed, dtype, data):
    tensors = [random_tensor(seed + k, 50 + k, dtype) for k in range(4)]
    prints = fp.Fingerprinter()
    before = prints.fingerprint(tensors)
    which = data.draw(st.integers(0, 3))
    element = data.draw(st.integers(0, tensors[which].numel() - 1))
    bit = data.draw(st.integers(0, tensors[which].element_size() * 8 - 1))
    fp.flip_bit(tensors[which], element, bit)
    assert int(prints.fingerprint(tensors)) != int(before)
    per_tensor = prints.many(tensors)
    fp.flip_bit(tensors[which], element, bit)                 # flipped back: the same again
    assert int(prints.fingerprint(tensors)) == int(before)
    assert [int(a) != int(b) for a, b in zip(per_tensor, prints.many(tensors))] == [k == which for k in range(4)]


def test_the_bits_not_the_values():
    prints = fp.Fingerprinter()
    assert int(prints.fingerprint([torch.tensor([0.0])])) != int(prints.fingerprint([torch.tensor([-0.0])]))
    nan, other_nan = torch.tensor([float("nan")]), torch.tensor([float("nan")])
    fp.flip_bit(other_nan, 0, 0)                              # another payload: still NaN, other bits
    assert torch.isnan(other_nan).all()
    assert int(prints.fingerprint([nan])) != int(prints.fingerprint([other_nan]))


def test_order_and_position_matter_and_chunks_are_exact():
    a, b = torch.arange(10, dtype=torch.float32), torch.arange(10, 20, dtype=torch.float32)
    prints = fp.Fingerprinter()
    assert int(prints.fingerprint([a, b])) != int(prints.fingerprint([b, a]))
    assert int(prints.tensor(a)) != int(prints.tensor(a.flip(0)))
    chunked = fp.Fingerprinter(batch=5, chunk_rows=1)
    big = torch.randn(1000)
    flipped = big.clone()
    fp.flip_bit(flipped, 999, 30)
    assert int(chunked.tensor(big)) != int(chunked.tensor(flipped))
    assert int(chunked.tensor(big)) == int(fp.Fingerprinter().tensor(big.clone()))   # chunks: same value


def test_missing_gradients_count_as_zero_and_the_world_of_one_gathers_itself():
    prints = fp.Fingerprinter()
    assert prints.many([None, torch.ones(2)]).tolist()[0] == 0
    assert fp.gather(torch.tensor([1, 2]), 1).tolist() == [[1, 2]]


def test_rows_chunks_and_batched_small_tensors():
    prints = fp.Fingerprinter(batch=300, chunk_rows=2)
    tensors = [torch.randn(n) for n in (3, 4096 * 5 + 7, 100, 250, 1)] + [torch.randn(7).to(torch.bfloat16)]
    before = int(prints.fingerprint(tensors))
    assert before == int(fp.Fingerprinter(batch=300, chunk_rows=2).fingerprint([t.clone() for t in tensors]))
    for which, element, bit in ((0, 2, 31), (1, 4096 * 5 + 3, 0), (1, 4096 * 2, 17), (3, 249, 5), (5, 6, 15)):
        fp.flip_bit(tensors[which], element, bit)
        assert int(prints.fingerprint(tensors)) != before, (which, element, bit)
        fp.flip_bit(tensors[which], element, bit)
    assert int(prints.fingerprint(tensors)) == before
