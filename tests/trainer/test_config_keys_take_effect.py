"""A setting that is accepted must take effect. `run.checkpoint_compress: lossless` was validated and then
never reached the checkpoint manager (the manifests said "none", the files were the same size): the static
test below catches that class for every key of the trainer's config, the run test proves this one."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from tests.trainer.helpers import train
from trainguard.trainer import config

ROOT = Path(__file__).resolve().parents[2]


def test_every_config_key_is_read_outside_the_config_module():
    """A key only config.py mentions is parsed, validated and ignored. Each must be read (`.key`) by the
    code it configures."""
    sources = [p.read_text() for folder in ("trainer", "trainguard", "protect") for p in (ROOT / folder).rglob("*.py")
               if p != ROOT / "trainer" / "config.py"]
    unread = [f"{section.name}.{key.name}" for section in dataclasses.fields(config.TrainConfig)
              for key in dataclasses.fields(section.default_factory())
              if not any(re.search(rf"\.{key.name}\b", text) for text in sources)]
    assert unread == []


def checkpoint(run_dir: Path) -> tuple[dict, int]:
    [folder] = sorted((run_dir / "checkpoints").glob("step_*"))
    manifest = json.loads((folder / "manifest.json").read_text())
    return manifest, sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.name != "manifest.json")


def test_checkpoint_compress_lossless_reaches_the_checkpoints(tmp_path):
    sizes = {}
    for mode in ("none", "lossless"):
        run = tmp_path / mode
        assert train(run, "--steps", "2", "--checkpoint-every", "2", "--set", f"run.checkpoint_compress={mode}") == 0
        manifest, sizes[mode] = checkpoint(run)
        assert manifest["layout"]["compress"] == mode
    assert sizes["lossless"] < sizes["none"]
