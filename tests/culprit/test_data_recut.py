"""The data position re-cut for a new world size: after a node is kept out, no window is read twice."""

from __future__ import annotations

import numpy as np

from trainguard.trainer.data import ShardLoader, TokenStream

T = 8


def _stream(tmp_path, n=2000):
    np.arange(n, dtype=np.uint16).tofile(tmp_path / "a.bin")
    return TokenStream([tmp_path / "a.bin"])


def _starts(loader: ShardLoader, batches: int) -> list[int]:
    return [int(x[0]) for _ in range(batches) for x in loader.next_batch(2)[0]]


def test_same_world_size_resumes_exactly_as_before(tmp_path):
    stream = _stream(tmp_path)
    first = ShardLoader(stream, block_size=T, rank=1, world_size=2, val_fraction=0.0)
    _starts(first, 3)
    again = ShardLoader(stream, block_size=T, rank=1, world_size=2, val_fraction=0.0)
    again.load_state_dict(first.state_dict())
    assert again.consumed == 6 and _starts(again, 1) == _starts(first, 1)


def test_two_ranks_to_one_reads_every_window_left_once(tmp_path):
    stream = _stream(tmp_path)
    old = [ShardLoader(stream, block_size=T, rank=r, world_size=2, val_fraction=0.0) for r in (0, 1)]
    before = [s for loader in old for s in _starts(loader, 5)]          # 10 windows each
    survivor = ShardLoader(stream, block_size=T, rank=0, world_size=1, val_fraction=0.0)
    survivor.load_state_dict(old[0].state_dict())                       # rank 0's checkpoint, saved at W=2
    after = _starts(survivor, survivor.windows // 2)
    read = before + after
    assert len(read) == len(set(read))                                  # no window twice
    assert not set(before) & set(after)
    covered = len(read) * T
    assert 2000 - covered < 3 * T                                       # nothing skipped but piece ends


def test_one_rank_to_three_and_back_keeps_every_window_unique(tmp_path):
    stream = _stream(tmp_path, 3000)
    solo = ShardLoader(stream, block_size=T, rank=0, world_size=1, val_fraction=0.0)
    read = _starts(solo, 7)
    state = solo.state_dict()
    three = [ShardLoader(stream, block_size=T, rank=r, world_size=3, val_fraction=0.0) for r in range(3)]
    for loader in three:
        loader.load_state_dict(state)
        read += _starts(loader, 4)
    back = ShardLoader(stream, block_size=T, rank=0, world_size=1, val_fraction=0.0)
    back.load_state_dict(three[0].state_dict())
    read += _starts(back, 5)
    assert len(read) == len(set(read))
    assert all(b - a >= T for a, b in zip(sorted(read), sorted(read)[1:]))   # windows never overlap
