"""The trainer's configuration: one dataclass tree, read from a YAML file and then from flags.

    model:  {n_layer: 2, n_head: 2, n_embd: 64, block_size: 64}
    optim:  {lr: 3.0e-3, batch_size: 8}
    run:    {steps: 40, checkpoint_every: 10}

A named preset (``tiny``, ``small``) is a YAML file in ``trainer/configs/``; ``--config`` takes a preset
name or a path. An unknown key or a value of the wrong type is an error naming the file and the key.
The launcher writes the fully resolved tree to ``RUN/config.yaml``, and every rank reads that file, so all
ranks (and a later look at the run) agree on exactly one configuration.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trainguard import safe_read
from trainguard.exits import BadInput

PRESETS_DIR = Path(__file__).with_name("configs")


class ConfigError(BadInput):
    pass


@dataclass
class ModelConfig:
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    block_size: int = 64
    vocab_size: int = 256        # byte-level tokens
    dropout: float = 0.0
    bias: bool = False


@dataclass
class DataConfig:
    # A directory of text files (byte-level tokens), a glob of uint16 .bin shards, or "" for the Python
    # standard library's own source, which exists on every machine offline.
    path: str = ""
    pattern: str = "*.py"        # which files of a text directory are read
    val_fraction: float = 0.02   # tail of the token stream held out for validation
    cache_dir: str = ""          # tokenised text cache; "" means ~/.cache/trainguard


@dataclass
class OptimConfig:
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 10
    decay_steps: int = 0         # cosine decay length; 0 means run.steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    batch_size: int = 8          # sequences per rank per optimizer step
    micro_batch_size: int = 0    # sequences per forward pass; 0 means batch_size (no accumulation)
    schedule: str = "cosine"     # cosine | breathing | phase (trainguard/decide/schedules.py)
    schedule_preset: str = "seed"   # seed: the policy's numbers (long runs) | cpu: spans scaled for CPU runs
    clip_rule: str = "fixed"     # fixed (grad_clip) | zscore | percentile (trainguard/decide/clipping.py)
    layer_reinit: bool = False   # a layer whose norm caused a rollback is also initialised again


@dataclass
class RunConfig:
    steps: int = 40
    seed: int = 1337
    device: str = "auto"         # auto | cpu | cuda
    telemetry: bool = True
    checkpoint_every: int = 0    # steps; 0: by time only (checkpoint_every_seconds)
    # The checkpoint autopilot (--checkpoint-every auto): the interval by time from the run's measured
    # failures, save and restart costs, starting from checkpoint_every_seconds (docs/checkpoints.md).
    checkpoint_auto: bool = False
    # Also by time (rank 0's clock, so all ranks agree); 0 = off. On by default: a first run with no
    # checkpoint until the end has nothing to roll back to, so every guard rollback would be impossible.
    checkpoint_every_seconds: float = 300.0
    checkpoint_on_error: str = "warn"       # a failed save: "warn" trains on (the previous one stays), "raise" ends
    keep_last: int = 3
    async_checkpoint: bool = False
    checkpoint_compress: str = "none"   # none | lossless (bit-exact, byte planes + zstd); fp16-zlib: exports only
    key_file: str = ""           # HMAC key for checkpoint manifests; "" means the checkpoint default
    eval_every: int = 0          # periodic validation loss (non-critical work: paused by cost_warn)
    eval_batches: int = 4        # validation batches per check (also the stable-checkpoint check)
    stable_val_factor: float = 1.5   # a checkpoint is stable if val loss <= factor * best so far
    policy: str = ""             # policy YAML (guard thresholds); "" means the defaults
    shadow: bool = False         # every action decided and recorded, none carried out (over actions.mode)
    inject: list = field(default_factory=list)   # fault injections, "KIND@STEP[:RANK]"
    peak_flops: float = 0.0      # peak FLOP/s per device for MFU; 0: the documented table (runtime/mfu.py), else no MFU
    gpu_count: int = -1          # system.gpu_count in the records (what cost is billed on); -1: GPUs in use
    run_id: str = ""             # "" means the run directory's name
    log_every: int = 10
    parallel: str = "ddp"        # ddp | fsdp2 (fully_shard: each rank holds a shard; trainer/parallel.py)


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def dump(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# ------------------------------------------------------------------------------------------- loading

def _coerce(value: Any, default: Any, name: str, source: str) -> Any:
    """`value` as the type of `default`, or a ConfigError naming source and key."""
    def wrong() -> ConfigError:
        return ConfigError(f"{source}: {name}: expected {type(default).__name__}, got {value!r}")

    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("on", "true", "yes", "1", "off", "false", "no", "0"):
            return value.lower() in ("on", "true", "yes", "1")
        raise wrong()
    if isinstance(default, int):
        if isinstance(value, bool):
            raise wrong()
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise wrong() from None
        raise wrong()
    if isinstance(default, float):
        if isinstance(value, bool):
            raise wrong()
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise wrong() from None
        raise wrong()
    if isinstance(default, list):
        if isinstance(value, list):
            return [str(item) for item in value]
        if isinstance(value, str):
            return [value]
        raise wrong()
    if isinstance(default, str):
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise wrong()
    raise wrong()


def apply_values(target: Any, values: Any, where: str, source: str) -> None:
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: {where or 'top level'}: expected a mapping, got {type(values).__name__}")
    known = {f.name for f in dataclasses.fields(target)}
    for key, value in values.items():
        name = f"{where}.{key}" if where else str(key)
        if key not in known:
            raise ConfigError(f"{source}: {name}: unknown key (known: {', '.join(sorted(known))})")
        current = getattr(target, key)
        if dataclasses.is_dataclass(current):
            apply_values(current, value, name, source)
        else:
            setattr(target, key, _coerce(value, current, name, source))


def config_path(name_or_path: str) -> Path:
    """A preset name (``tiny``) or a path to a YAML file."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        return path
    preset = PRESETS_DIR / f"{name_or_path}.yaml"
    if not preset.exists():
        names = ", ".join(sorted(p.stem for p in PRESETS_DIR.glob("*.yaml")))
        raise ConfigError(f"{name_or_path}: no such config file or preset (presets: {names})")
    return preset


def load_file(config: TrainConfig, name_or_path: str) -> TrainConfig:
    """Overlay a YAML file (or preset) on `config`, in place."""
    path = config_path(name_or_path)
    source = str(path)
    try:
        data = safe_read.read_yaml(path, what="config file") or {}
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such config file") from None
    except OSError as exc:      # a FIFO, a device, a directory, too large: named by safe_read
        raise ConfigError(str(exc)) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    apply_values(config, data, "", source)
    return config


def set_value(config: TrainConfig, assignment: str, source: str = "--set") -> None:
    """Apply one ``section.key=value`` override (value parsed as YAML: numbers, booleans, lists)."""
    key, sep, raw = assignment.partition("=")
    if not sep or "." not in key:
        raise ConfigError(f"{source}: expected SECTION.KEY=VALUE, got {assignment!r}")
    section, _, name = key.strip().partition(".")
    try:
        value = safe_read.load_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    apply_values(config, {section: {name: value}}, "", source)


def _finite(value: float, low: float, high: float = math.inf) -> bool:
    """`low <= value <= high`, and a number (NaN compares false to everything, so `not value < 0` lets it in)."""
    return math.isfinite(value) and low <= value <= high


def validate(config: TrainConfig, source: str = "config") -> TrainConfig:
    m, o, r = config.model, config.optim, config.run
    checks = [
        # A negative or zero size builds no model (n_layer=-1 made an empty GPT that refused every
        # checkpoint); a NaN or negative rate reached torch.optim as a traceback on every rank.
        (m.n_layer >= 1, "model.n_layer", "must be at least 1"),
        (m.n_head >= 1, "model.n_head", "must be at least 1"),
        (m.n_embd >= 1, "model.n_embd", "must be at least 1"),
        (m.block_size >= 1, "model.block_size", "must be at least 1"),
        (_finite(m.dropout, 0.0, 1.0) and m.dropout < 1.0, "model.dropout", "must be in [0, 1)"),
        (_finite(o.lr, 0.0) and o.lr > 0, "optim.lr", f"must be a finite number above 0, got {o.lr}"),
        (_finite(o.min_lr, 0.0), "optim.min_lr", f"must be a finite number, 0 or more, got {o.min_lr}"),
        (o.warmup_steps >= 0, "optim.warmup_steps", "must not be negative"),
        (o.decay_steps >= 0, "optim.decay_steps", "must not be negative"),
        (_finite(o.weight_decay, 0.0), "optim.weight_decay", "must be a finite number, 0 or more"),
        (_finite(o.beta1, 0.0) and o.beta1 < 1, "optim.beta1", "must be in [0, 1)"),
        (_finite(o.beta2, 0.0) and o.beta2 < 1, "optim.beta2", "must be in [0, 1)"),
        (_finite(o.grad_clip, 0.0), "optim.grad_clip", "must be a finite number, 0 or more"),
        (r.checkpoint_every >= 0, "run.checkpoint_every", "must not be negative (0 saves only at the end)"),
        (not (r.checkpoint_auto and r.checkpoint_every), "run.checkpoint_auto",
         "the autopilot chooses the interval by time: leave run.checkpoint_every at 0"),
        (_finite(r.checkpoint_every_seconds, 0.0), "run.checkpoint_every_seconds",
         "must be a finite number, 0 (off) or more"),
        (r.keep_last >= 1, "run.keep_last", f"must be at least 1, got {r.keep_last}"),
        (r.eval_every >= 0, "run.eval_every", "must not be negative (0 is off)"),
        (r.eval_batches >= 1, "run.eval_batches", "must be at least 1"),
        (_finite(r.stable_val_factor, 0.0) and r.stable_val_factor > 0, "run.stable_val_factor",
         "must be a finite number above 0"),
        (_finite(r.peak_flops, 0.0), "run.peak_flops", "must be a finite number, 0 (the table) or more"),
        (r.gpu_count >= -1, "run.gpu_count", "must be -1 (the GPUs in use) or more"),
        (m.n_embd % m.n_head == 0, "model.n_embd", f"must be divisible by model.n_head ({m.n_head})"),
        (m.vocab_size >= 256, "model.vocab_size", "byte-level data needs at least 256"),
        (o.batch_size >= 1, "optim.batch_size", "must be at least 1"),
        (0 <= o.micro_batch_size <= o.batch_size, "optim.micro_batch_size", "must be 0..optim.batch_size"),
        (r.steps >= 0, "run.steps", "must not be negative"),
        (r.device in ("auto", "cpu", "cuda"), "run.device", "must be auto, cpu or cuda"),
        (r.checkpoint_on_error in ("warn", "raise"), "run.checkpoint_on_error", "must be warn or raise"),
        (r.checkpoint_compress in ("none", "lossless"), "run.checkpoint_compress",
         "must be none or lossless (fp16-zlib is lossy: only for `trainguard checkpoint export`, never for "
         "the checkpoints a run resumes from)"),
        (r.parallel in ("ddp", "fsdp2"), "run.parallel", "must be ddp or fsdp2"),
        (0 < config.data.val_fraction < 0.5, "data.val_fraction", "must be between 0 and 0.5"),
        (o.schedule in ("cosine", "breathing", "phase"), "optim.schedule", "must be cosine, breathing or phase"),
        (o.schedule_preset in ("seed", "cpu"), "optim.schedule_preset", "must be seed or cpu"),
        (o.clip_rule in ("fixed", "zscore", "percentile"), "optim.clip_rule", "must be fixed, zscore or percentile"),
    ]
    for ok, key, message in checks:
        if not ok:
            raise ConfigError(f"{source}: {key}: {message}")
    return config


def default_preset(device: str) -> str:
    return "small" if device == "cuda" else "tiny"
