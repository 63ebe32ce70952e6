"""The training state a checkpoint holds: how it is split into files, checked, and copied off the device.

``{"model": ..., "optim": ...}`` each get their own file (``model.pt``, ``optim.pt``); every other key
(``sched``, ``data``, ``rng``, ...) goes together into ``extra.pt``. Loading gives the same dict back.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from trainguard.trainer.checkpoint.manifest import CheckpointError

OWN_FILES = {"model": "model.pt", "optim": "optim.pt"}
EXTRA_FILE = "extra.pt"

# What torch.load(weights_only=True) accepts besides tensors (checked against torch 2.13). A state with
# anything else would save fine and then refuse to load, so it is refused at save time instead.
_LEAVES = (type(None), bool, int, float, complex, str, bytes)
_CONTAINERS = (dict, OrderedDict, list, tuple, set)


def split(state: dict) -> dict[str, Any]:
    """File name -> object to save in it."""
    if not isinstance(state, dict):
        raise CheckpointError(f"a checkpoint state is a dict, got {type(state).__name__}", code="bad_state")
    files: dict[str, Any] = {}
    extra = {}
    for key, value in state.items():
        if not isinstance(key, str):
            raise CheckpointError(f"state keys are strings, got {key!r}", code="bad_state")
        if key in OWN_FILES:
            files[OWN_FILES[key]] = value
        else:
            extra[key] = value
    if extra:
        files[EXTRA_FILE] = extra
    return files


def join(parts: dict[str, Any]) -> dict:
    """The inverse of `split`: file name -> loaded object, back into the state dict."""
    state = {}
    for key, name in OWN_FILES.items():
        if name in parts:
            state[key] = parts[name]
    state.update(parts.get(EXTRA_FILE, {}))
    return state


def check_loadable(obj: Any, where: str = "state") -> None:
    """Raise CheckpointError naming the first value that weights_only loading would refuse."""
    import torch

    if isinstance(obj, torch.Tensor) or isinstance(obj, _LEAVES) and type(obj) in _LEAVES:
        return
    if isinstance(obj, (torch.Size, torch.dtype, torch.device)):
        return
    if type(obj) in _CONTAINERS:
        if isinstance(obj, dict):
            for key, value in obj.items():
                check_loadable(key, f"{where} key {key!r}")
                check_loadable(value, f"{where}[{key!r}]")
        else:
            for index, value in enumerate(obj):
                check_loadable(value, f"{where}[{index}]")
        return
    raise CheckpointError(
        f"{where}: a {type(obj).__module__}.{type(obj).__qualname__} cannot be loaded with "
        "torch.load(weights_only=True); store tensors, numbers, strings, lists or dicts "
        "(e.g. torch.from_numpy(array) or array.tolist())", code="bad_state")


def snapshot(obj: Any, memo: dict | None = None) -> Any:
    """A copy of the state that training cannot change under the writer: tensor storages copied to CPU
    memory, containers rebuilt. Tensors that share a storage (tied weights) still share the copy, so the
    file written is the same, byte for byte, as a sync save of the original."""
    import torch

    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        return _copy_tensor(obj.detach(), memo)
    if isinstance(obj, dict):
        copy = type(obj)((key, snapshot(value, memo)) for key, value in obj.items())
        # state_dict() hangs `_metadata` (module versions, used by load_state_dict) on its OrderedDict.
        for name, value in getattr(obj, "__dict__", {}).items():
            setattr(copy, name, snapshot(value, memo))
        return copy
    if isinstance(obj, (list, tuple, set)) and not isinstance(obj, torch.Size):
        return type(obj)(snapshot(value, memo) for value in obj)
    return obj  # immutable leaves


def _copy_tensor(tensor: Any, memo: dict) -> Any:
    import torch

    storage = tensor.untyped_storage()
    key = (tensor.device, storage.data_ptr()) if storage.nbytes() else ("empty", id(tensor))
    if key not in memo:
        memo[key] = storage.clone() if tensor.device.type == "cpu" else storage.cpu()
    copy = torch.empty((0,), dtype=tensor.dtype)
    return copy.set_(memo[key], tensor.storage_offset(), tensor.size(), tensor.stride())
