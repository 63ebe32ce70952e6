"""`checkpoint.compress`: lossless is bit-exact and smaller; fp16-zlib only as an export, within the
error its manifest records, and never resumed from."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from tests.checkpoint.helpers import assert_same, training_state
from trainguard.cli import main
from trainguard.trainer import config as cfg
from trainguard.runtime.checkpoint import CheckpointManager, verify
from trainguard.runtime.checkpoint import compress


def _state() -> dict:
    state, _, _ = training_state(n_embd=64)
    state["model"]["half"] = torch.randn(1001).to(torch.bfloat16)     # 2-byte words, an odd count
    state["model"]["ids"] = torch.arange(37, dtype=torch.int64)
    return state


def _stored_bytes(manager: CheckpointManager, step: int) -> int:
    manifest = json.loads((manager.root / f"step_{step}" / "manifest.json").read_text())
    return sum(entry["bytes"] for name, entry in manifest["files"].items() if name.endswith(".distcp"))


def test_lossless_round_trips_bit_exact_and_is_smaller(tmp_path, key_file):
    state = _state()
    plain = CheckpointManager(tmp_path / "plain", key_file=key_file)
    packed = CheckpointManager(tmp_path / "packed", key_file=key_file, compress="lossless")
    plain.save(1, state, stable=True)
    packed.save(1, state, stable=True)
    _, restored = packed.load_latest()
    assert_same(restored, state)                       # every bit of every tensor
    assert _stored_bytes(packed, 1) < _stored_bytes(plain, 1)
    step = packed.root / "step_1"
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["layout"]["compress"] == "lossless"
    for name, entry in manifest["files"].items():      # the hashes are of the bytes as stored
        assert hashlib.sha256((step / name).read_bytes()).hexdigest() == entry["sha256"]
    assert verify(step, key_file=key_file).ok


def test_byte_planes_put_back_together_exactly():
    for data in (b"", b"\x01", bytes(range(256)) * 3 + b"\x07\x08\x09"):
        assert compress._join_planes(compress._split_planes(data)) == data


def test_fp16_zlib_is_an_export_within_its_recorded_error_and_never_resumed(tmp_path, key_file, capsys):
    state = _state()
    CheckpointManager(tmp_path / "run", key_file=key_file).save(5, state, stable=True)
    capsys.readouterr()   # the save's own log line
    code = main(["checkpoint", "export", str(tmp_path / "run"), "--to", str(tmp_path / "out"),
                 "--key-file", str(key_file), "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["step"] == 5 and report["compress"] == "fp16-zlib" and 0 < report["max_abs_error"] < 1e-2
    assert 0 < report["max_rel_error"] <= 2 ** -11          # float16's rounding: half an ulp at most

    export = CheckpointManager(tmp_path / "out", key_file=key_file)
    assert verify(export.root / "step_5", key_file=key_file).ok
    assert export.latest_verified() is None and export.load_latest() is None   # never a resume point
    restored = export.load(_export_checkpoint(export))   # loadable on purpose, by name
    for name, tensor in state["model"].items():
        got = restored["model"][name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape
        if tensor.is_floating_point():
            assert (got.double() - tensor.double()).abs().max() <= report["max_abs_error"]
        else:
            assert torch.equal(got, tensor)
    plain = sum(e["bytes"] for e in json.loads((tmp_path / "run" / "checkpoints" / "step_5" / "manifest.json")
                                               .read_text())["files"].values())
    assert report["bytes"] < plain * 0.6


def _export_checkpoint(manager: CheckpointManager):
    from trainguard.runtime.checkpoint import Checkpoint

    return Checkpoint.of(verify(manager.root / "step_5", key_file=manager.key_path, deep=False))


def test_lossy_compression_is_refused_for_checkpoints_a_run_resumes_from(tmp_path, key_file):
    with pytest.raises(ValueError, match="only for exports"):
        CheckpointManager(tmp_path, key_file=key_file, compress="fp16-zlib")
    config = cfg.TrainConfig()
    cfg.set_value(config, "run.checkpoint_compress=fp16-zlib")
    with pytest.raises(cfg.ConfigError, match="run.checkpoint_compress: .*only for `trainguard checkpoint export`"):
        cfg.validate(config)
