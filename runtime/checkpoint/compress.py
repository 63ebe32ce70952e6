"""`checkpoint.compress`: none | lossless | fp16-zlib. Hashes always cover the bytes as stored.

- ``lossless``: each DCP item's bytes are split into 4 byte planes (byte 0 of every 4-byte word, then
  byte 1, ...) and compressed with zstd. In float32 (and the high bytes of bf16) the sign and exponent
  bytes of neighbouring values are alike, so a plane of them compresses well where the interleaved bytes
  do not. Bit-exact: the planes are put back together on read.
- ``fp16-zlib``: the seed's lossy form. Floating tensors are cast to float16 and the items zlib-compressed;
  the largest absolute and relative error introduced is recorded in the manifest. Only for checkpoints
  saved as *exports*; a resume never picks one (`CheckpointManager.latest_verified` skips them).

Both are DCP stream extensions, so they apply per item and a compressed checkpoint still reshards.
"""

from __future__ import annotations

import io
import zlib
from typing import IO, Any

import numpy as np

NONE, LOSSLESS, FP16_ZLIB = "none", "lossless", "fp16-zlib"
MODES = (NONE, LOSSLESS, FP16_ZLIB)
PLANES = 4


def _split_planes(data: bytes) -> bytes:
    """[b0 b1 b2 b3 b0 b1 b2 b3 ...] -> [b0 b0 ...][b1 b1 ...][b2 ...][b3 ...] + the unaligned tail."""
    body = len(data) - len(data) % PLANES
    words = np.frombuffer(data, dtype=np.uint8, count=body).reshape(-1, PLANES)
    return np.ascontiguousarray(words.T).tobytes() + data[body:]


def _join_planes(data: bytes) -> bytes:
    body = len(data) - len(data) % PLANES
    planes = np.frombuffer(data, dtype=np.uint8, count=body).reshape(PLANES, -1)
    return np.ascontiguousarray(planes.T).tobytes() + data[body:]


class _BufferedWriter(io.RawIOBase):
    """Collects an item's bytes; on close writes `encode(bytes)` to the stream below and closes it."""

    def __init__(self, output: IO[bytes], encode: Any):
        super().__init__()
        self._output, self._encode, self._parts = output, encode, []

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._parts.append(bytes(view))
        return view.nbytes

    def close(self) -> None:
        if not self.closed:
            self._output.write(self._encode(b"".join(self._parts)))
            self._output.close()
        super().close()


def _extension_classes():
    from torch.distributed.checkpoint._extension import StreamTransformExtension

    class BytePlaneZstd(StreamTransformExtension):
        """Lossless: byte planes, then zstd."""

        @staticmethod
        def registry_name() -> str:
            return "trainguard.byteplane-zstd"

        @staticmethod
        def from_descriptor(version: str) -> "BytePlaneZstd":
            if version.partition(".")[0] != "1":
                raise ValueError(f"unknown version {version} of trainguard.byteplane-zstd")
            return BytePlaneZstd()

        def get_descriptor(self) -> str:
            return f"{self.registry_name()}/1"

        def transform_to(self, output: IO[bytes]) -> IO[bytes]:
            import zstandard

            compressor = zstandard.ZstdCompressor(level=3)
            return _BufferedWriter(output, lambda data: compressor.compress(_split_planes(data)))

        def transform_from(self, input: IO[bytes]) -> IO[bytes]:
            import zstandard

            with zstandard.ZstdDecompressor().stream_reader(input) as reader:
                return io.BytesIO(_join_planes(reader.read()))

    class Zlib(StreamTransformExtension):
        """zlib over an item's bytes (the fp16 export's second half)."""

        @staticmethod
        def registry_name() -> str:
            return "trainguard.zlib"

        @staticmethod
        def from_descriptor(version: str) -> "Zlib":
            if version.partition(".")[0] != "1":
                raise ValueError(f"unknown version {version} of trainguard.zlib")
            return Zlib()

        def get_descriptor(self) -> str:
            return f"{self.registry_name()}/1"

        def transform_to(self, output: IO[bytes]) -> IO[bytes]:
            return _BufferedWriter(output, lambda data: zlib.compress(data, 6))

        def transform_from(self, input: IO[bytes]) -> IO[bytes]:
            return io.BytesIO(zlib.decompress(input.read()))

    return BytePlaneZstd, Zlib


def writer_extensions(mode: str) -> list | None:
    byteplane, zlib_ext = _extension_classes()
    return {NONE: None, LOSSLESS: [byteplane()], FP16_ZLIB: [zlib_ext()]}[mode]


def reader_registry() -> Any:
    """The registry a reader needs for any checkpoint (extensions are named per item in .metadata)."""
    from torch.distributed.checkpoint._extension import ExtensionRegistry

    registry = ExtensionRegistry()
    for cls in _extension_classes():
        registry.register(cls)
    return registry


def to_fp16(state: Any, errors: dict) -> Any:
    """`state` with every floating tensor cast to float16; `errors` gets the largest absolute and relative
    error of the cast and the original dtype of each cast tensor (by path, to cast back on load)."""
    import torch

    def cast(obj: Any, path: str) -> Any:
        # 0-d tensors (an optimizer's step count) stay exact: fp16 holds integers only up to 2048.
        if isinstance(obj, torch.Tensor) and obj.is_floating_point() and obj.dtype != torch.float16 \
                and obj.dim() > 0:
            half = obj.detach().to(torch.float16)
            diff = (half.to(obj.dtype) - obj.detach()).abs()
            if diff.numel():
                errors["max_abs_error"] = max(errors.get("max_abs_error", 0.0), float(diff.max()))
                scale = obj.detach().abs().clamp_min(torch.finfo(torch.float16).tiny)
                errors["max_rel_error"] = max(errors.get("max_rel_error", 0.0), float((diff / scale).max()))
            errors.setdefault("dtypes", {})[path] = str(obj.dtype).removeprefix("torch.")
            return half
        if isinstance(obj, dict):
            return type(obj)((key, cast(value, f"{path}.{key}" if path else str(key))) for key, value in obj.items())
        if isinstance(obj, (list, tuple)):
            return type(obj)(cast(value, f"{path}.{i}") for i, value in enumerate(obj))
        return obj

    return cast(state, "")


def restore_dtypes(state: Any, dtypes: dict[str, str]) -> Any:
    """Cast the tensors an fp16 export narrowed back to their saved dtypes (values keep the fp16 error)."""
    import torch

    def back(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor) and path in dtypes:
            return obj.to(getattr(torch, dtypes[path]))
        if isinstance(obj, dict):
            return type(obj)((key, back(value, f"{path}.{key}" if path else str(key))) for key, value in obj.items())
        if isinstance(obj, list):
            return [back(value, f"{path}.{i}") for i, value in enumerate(obj)]
        return obj

    return back(state, "") if dtypes else state
