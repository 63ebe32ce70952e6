"""Data: byte-level text (stdlib by default) and uint16 .bin shards; per-rank shards; exact position."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainguard.trainer.config import DataConfig
from trainguard.trainer.data import DataError, ShardLoader, TokenStream, open_stream, tokenize_dir


def test_text_directory_is_bytes_in_sorted_order_and_cached(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "b.txt").write_bytes(b"world")
    (corpus / "a.txt").write_bytes(b"hello ")
    (corpus / "sub" / "c.txt").write_bytes(b"!")
    (corpus / "site-packages").mkdir()
    (corpus / "site-packages" / "z.txt").write_bytes(b"not me")
    cached = tokenize_dir(corpus, "*.txt", tmp_path / "cache")
    assert bytes(np.fromfile(cached, dtype=np.uint16).astype(np.uint8)) == b"hello world!"
    assert tokenize_dir(corpus, "*.txt", tmp_path / "cache") == cached        # reused, not rebuilt
    (corpus / "a.txt").write_bytes(b"HELLO ")
    assert tokenize_dir(corpus, "*.txt", tmp_path / "cache") != cached        # a changed file is noticed


def test_default_corpus_is_the_stdlib_and_deterministic(tmp_path):
    first = open_stream(DataConfig(cache_dir=str(tmp_path)))
    again = open_stream(DataConfig(cache_dir=str(tmp_path)))
    assert len(first) > 1_000_000 and np.array_equal(first.read(0, 5000), again.read(0, 5000))
    assert first.read(0, 5000).max() < 256


def test_bin_shards_read_as_one_stream_and_each_rank_its_own_share(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16)
    tokens[:400].tofile(tmp_path / "shard_000.bin")
    tokens[400:].tofile(tmp_path / "shard_001.bin")
    stream = open_stream(DataConfig(path=str(tmp_path / "*.bin")))
    assert len(stream) == 1000 and list(stream.read(398, 403)) == [398, 399, 400, 401, 402]
    loaders = [ShardLoader(stream, block_size=10, rank=r, world_size=2, val_fraction=0.1) for r in (0, 1)]
    x0, y0 = loaders[0].next_batch(3)
    x1, _ = loaders[1].next_batch(3)
    assert x0[0].tolist() == list(range(10)) and y0[0].tolist() == list(range(1, 11))
    assert x0[2, 0].item() == 20 and x1[0, 0].item() == 450        # rank 1 starts half-way into 900 tokens
    val = ShardLoader(stream, block_size=10, rank=0, world_size=2, split="val", val_fraction=0.1)
    assert val.next_batch(1)[0][0, 0].item() == 900


def test_position_is_exact_resumable_and_skippable(tmp_path):
    np.arange(500, dtype=np.uint16).tofile(tmp_path / "a.bin")
    stream = TokenStream([tmp_path / "a.bin"])
    loader = ShardLoader(stream, block_size=8, rank=0, world_size=1, val_fraction=0.02)
    loader.next_batch(4)
    saved = loader.state_dict()
    expected = loader.next_batch(4)
    resumed = ShardLoader(stream, block_size=8, rank=0, world_size=1, val_fraction=0.02)
    resumed.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(resumed.next_batch(4), expected))
    resumed.skip(10)
    assert resumed.tokens_loaded() == (4 + 4 + 10) * 8
    for _ in range(20):                       # past the end of the share it wraps around: a new epoch
        x, y = resumed.next_batch(4)
        assert torch.equal(x[:, 1:], y[:, :-1])
    assert resumed.epoch >= 1


def test_bad_sources_are_refused_with_the_path(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(DataError, match="odd.bin: not a uint16 .bin shard"):
        open_stream(DataConfig(path=str(tmp_path / "*.bin")))
    with pytest.raises(DataError, match="matches no directory or .bin files"):
        open_stream(DataConfig(path=str(tmp_path / "none-*.bin")))
    np.arange(100, dtype=np.uint16).tofile(tmp_path / "small.bin")
    with pytest.raises(DataError, match="too few"):
        ShardLoader(TokenStream([tmp_path / "small.bin"]), block_size=64, rank=0, world_size=2)
