"""Loading sharded checkpoints (DCP, format /2) back, trusting nothing that was not verified, into any layout.

`trainguard.runtime.checkpoint.store` hashes the files first and hands their stats here. `SafeReader`
unpickles ``.metadata`` with an allowlist (DCP itself uses a bare ``pickle.load``), opens each shard only
if its size and times are still those that were hashed, and the planners load non-tensor items with
``weights_only=True`` (DCP's default planner uses ``weights_only=False``). Tensor items are loaded by DCP
with ``weights_only=True`` already.

Two ways in: `load_into` loads into the caller's state in place, resharded to its layout (DTensors of any
world size, every rank together); `load_full` rebuilds the whole state in one process. `files_read` says
ahead which shard files a rank's load will read, so only those are hashed. The writing side is `sharded.py`.
"""

from __future__ import annotations

import io
import os
import pickle
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from trainguard.runtime.checkpoint.manifest import CheckpointError
from trainguard.runtime.checkpoint.sharded import METADATA, dcp, dcp_errors


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle; only the classes that describe a checkpoint may appear in it."""

    _MODULES = {"torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"}

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module in self._MODULES and not name.startswith("__"):
            found = getattr(__import__(module, fromlist=[name]), name, None)
            if isinstance(found, type) or name == "_MEM_FORMAT_ENCODING":
                return found
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if (module, name) in (("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                              ("pathlib", "PurePosixPath")):
            return getattr(__import__(module, fromlist=[name]), name)
        raise pickle.UnpicklingError(f"{METADATA}: global '{module}.{name}' is not allowed in checkpoint metadata")


def read_metadata_bytes(data: bytes) -> Any:
    """The DCP metadata from verified bytes; CheckpointError("unsafe_content") for anything else."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{METADATA}: refused ({exc})", code="unsafe_content") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{METADATA}: not DCP metadata", code="unsafe_content")
    return metadata


def _reader_class():
    from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class VerifiedFileSystem(FileSystem):
        """Opens a shard only if the opened descriptor is still the file that was hashed (same inode,
        size, mtime and ctime: a rename over it or a write into it since shows)."""

        def __init__(self, verified: dict[str, os.stat_result]):
            super().__init__()
            self.verified = verified

        @contextmanager
        def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
            with super().create_stream(path, mode) as stream:
                _still_as_verified(Path(path), os.fstat(stream.fileno()), self.verified.get(Path(path).name))
                yield stream

    class SafeReader(FileSystemReader):
        """Reads only what was verified: `.metadata` as parsed from the verified bytes with an allowlist
        (`read_metadata_bytes`), each shard through `VerifiedFileSystem`."""

        def __init__(self, folder: Path, metadata: Any, verified: dict[str, os.stat_result],
                     extension_registry: Any = None):
            super().__init__(folder, _extension_registry=extension_registry)
            self.fs = VerifiedFileSystem(verified)
            self._metadata = metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = self._metadata
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader


def _still_as_verified(path: Path, now: os.stat_result, seen: os.stat_result | None) -> None:
    if seen is None:
        raise CheckpointError(f"{path.name} is read by the checkpoint but was not verified (not in its "
                              "manifest, or not in this rank's load plan)", code="missing_file", path=path)
    if (now.st_size, now.st_mtime_ns, now.st_ctime_ns, now.st_ino) != (seen.st_size, seen.st_mtime_ns,
                                                                       seen.st_ctime_ns, seen.st_ino):
        raise CheckpointError(f"{path.name} changed after it was verified", code="hash_mismatch", path=path)


def _load_bytes_safely(value: io.BytesIO) -> Any:
    import torch

    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as exc:
        first = next((line for line in str(exc).splitlines() if "GLOBAL" in line or "Unsupported" in line),
                     type(exc).__name__)
        raise CheckpointError(f"torch.load(weights_only=True) refused an item ({first.strip()})",
                              code="unsafe_content") from None


def _planners():
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DCP's planner, loading non-tensor items with weights_only=True."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            loaded = _load_bytes_safely(value)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    class SafeFullPlanner(_EmptyStateDictLoadPlanner):
        """Rebuilds the whole state from the metadata (no target needed), non-tensors weights_only."""

        load_bytes = SafeLoadPlanner.load_bytes

    return SafeLoadPlanner, SafeFullPlanner


def files_read(target: dict | None, metadata: Any) -> set[str] | None:
    """The shard files a load into `target` reads (DCP's own planning of this rank's reads, done ahead on a
    planner of its own, which leaves `target` as it is), or None for a whole load (every file)."""
    if target is None:
        return None
    safe, _ = _planners()
    planner = safe()
    with dcp_errors():
        planner.set_up_planner(target, metadata, False)
        plan = planner.create_local_plan()
    return {metadata.storage_data[item.storage_index].relative_path for item in plan.items}


def load_into(folder: Path, target: dict, metadata: Any, verified: dict[str, os.stat_result], *,
              process_group: Any = None, distributed: bool = False, extensions: Any = None) -> None:
    """DCP-load into `target` in place, resharding to its layout (DTensors of any world size)."""
    safe, _ = _planners()
    reader = _reader_class()(folder, metadata, verified, extensions)
    with dcp_errors():
        dcp().load(target, storage_reader=reader, planner=safe(), process_group=process_group,
                    no_dist=not distributed)


def load_full(folder: Path, metadata: Any, verified: dict[str, os.stat_result], *,
              int_key_paths: list[list[str]] = (), extensions: Any = None) -> dict:
    """The whole saved state as plain tensors, in this process (no collective): any world size can read
    it. Dicts whose keys were ints when saved (an optimizer's `state`; `sharded.int_key_paths` recorded
    them in the layout) get int keys back."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    _, full = _planners()
    reader = _reader_class()(folder, metadata, verified, extensions)
    state: dict = {}
    with dcp_errors():
        _load_state_dict(state, storage_reader=reader, planner=full(), no_dist=True)
    for path in int_key_paths:
        _restore_int_keys(state, path)
    return state


def _restore_int_keys(state: Any, path: list[str]) -> None:
    holder = state
    for part in path[:-1]:
        holder = holder[int(part)] if isinstance(holder, list) else holder.setdefault(part, {})
        if not isinstance(holder, (dict, list)):
            return
    last = path[-1] if path else None
    if last is None:
        return
    if isinstance(holder, list):
        holder[int(last)] = {int(k): v for k, v in holder[int(last)].items()}
    elif isinstance(holder, dict) and isinstance(holder.setdefault(last, {}), dict):
        holder[last] = {int(k): v for k, v in holder[last].items()}
