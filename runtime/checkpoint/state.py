"""The training state a checkpoint holds: how it is split into files, checked, and copied off the device.

``{"model": ..., "optim": ...}`` each get their own file (``model.pt``, ``optim.pt``); every other key
(``sched``, ``data``, ``rng``, ...) goes together into ``extra.pt``. Loading gives the same dict back.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from trainguard.runtime.checkpoint.manifest import CheckpointError

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


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in a state (nested dicts, lists, tuples): about what a file of it weighs."""
    if isinstance(obj, dict):
        return sum(tensor_bytes(value) for value in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(value) for value in obj)
    nbytes = getattr(obj, "nbytes", None)
    return nbytes if isinstance(nbytes, int) else 0


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


class Stager:
    """Copies the state off the device into host buffers that are kept and reused from one save to the next.

    Training cannot change the copy under the writer. Tensors that share a storage (tied weights) share
    the copy, so the file written is the same, byte for byte, as a sync save of the original. Reuse
    matters: allocating (and first touching) hundreds of MB of fresh memory costs more than copying into
    it. The buffers of GPU tensors are pinned, so the copy runs at full bus speed, and one synchronize
    waits for all of them. The price is one copy of the state held in host memory between saves.
    """

    def __init__(self) -> None:
        self._buffers: list[Any] = []
        self._next = 0
        self._from_gpu = False

    def stage(self, obj: Any) -> Any:
        """A copy of `obj` (the caller must not stage again until the previous copy has been written)."""
        import torch

        self._next, self._from_gpu = 0, False
        copy = self._copy(obj, {})
        if self._from_gpu:
            torch.cuda.synchronize()
        return copy

    def _copy(self, obj: Any, memo: dict) -> Any:
        import torch

        if isinstance(obj, torch.Tensor):
            return self._copy_tensor(obj.detach(), memo)
        if isinstance(obj, dict):
            copy = type(obj)((key, self._copy(value, memo)) for key, value in obj.items())
            # state_dict() hangs `_metadata` (module versions, used by load_state_dict) on its OrderedDict.
            for name, value in getattr(obj, "__dict__", {}).items():
                setattr(copy, name, self._copy(value, memo))
            return copy
        if isinstance(obj, (list, tuple, set)) and not isinstance(obj, torch.Size):
            return type(obj)(self._copy(value, memo) for value in obj)
        return obj  # immutable leaves

    def _copy_tensor(self, tensor: Any, memo: dict) -> Any:
        import torch

        storage = tensor.untyped_storage()
        key = (tensor.device, storage.data_ptr()) if storage.nbytes() else ("empty", id(tensor))
        if key not in memo:
            on_gpu = tensor.device.type != "cpu"
            self._from_gpu |= on_gpu
            buffer = self._buffer(storage.nbytes(), pinned=on_gpu and torch.cuda.is_available())
            memo[key] = buffer.copy_(storage, non_blocking=on_gpu)
        copy = torch.empty((0,), dtype=tensor.dtype)
        return copy.set_(memo[key], tensor.storage_offset(), tensor.size(), tensor.stride())

    def _buffer(self, nbytes: int, pinned: bool) -> Any:
        """The next buffer in visiting order; the state has the same shape every save, so it fits."""
        import torch

        index, self._next = self._next, self._next + 1
        if index < len(self._buffers):
            buffer = self._buffers[index]
            if buffer.nbytes() == nbytes and buffer.is_pinned() == pinned:
                return buffer
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned).untyped_storage()
        if index < len(self._buffers):
            self._buffers[index] = buffer
        else:
            self._buffers.append(buffer)
        return buffer
