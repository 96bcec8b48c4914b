"""One entry file: a sample's boundary activation on disk, its name, header and checksums.

The activation store (:mod:`~lightning_pipetransformer.cache.store`) keeps entries in memory and
on disk; this module is what one entry looks like on disk, so that the format is read and written
in one place whichever tier decides to. A file is ``<key>.safetensors``:

- safetensors: a JSON header and raw little-endian tensors, read through a memory map. No pickle
  anywhere, so opening a cache directory cannot run code;
- the tensors: ``hidden`` (the activation, in the storage dtype) and ``x.<name>`` for each extra
  per-sample tensor stored with it (the block inputs needed to advance it, in their own dtype);
- the header's metadata repeats the format, :data:`~lightning_pipetransformer.cache.validity.FORMAT_VERSION`,
  fingerprint, boundary and key (:func:`header`), and the activation's original dtype. An entry
  whose metadata does not match what the reader expects (another model, another boundary, a
  renamed or foreign file) is refused, never returned;
- ``crc32.<name>``: the CRC-32 of each tensor's bytes (:func:`checksum`), checked on every read: a
  file whose bytes changed under an intact header (a torn write, a bad sector, a tool that
  rewrote it) is :class:`CorruptEntryFile`.

Writers write a unique temporary name and ``os.replace`` it into place (:func:`write_entry`), so
concurrent writers of one key are safe (both write the same bytes) and a reader sees a whole file
or none.
"""

from __future__ import annotations

import os
import secrets
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_save
from torch import Tensor

from lightning_pipetransformer.cache.keys import KEY_PATTERN
from lightning_pipetransformer.cache.validity import FORMAT_VERSION

__all__ = [
    "SUFFIX", "CorruptEntryFile", "check_keys", "checksum", "dtype_name", "encode", "entry_path", "header", "key_of",
    "read_entry", "write_entry",
]  # fmt: skip

_FORMAT = "pipetransformer-activation"
#: What an entry file's name ends with (the rest is its key).
SUFFIX = ".safetensors"
_HIDDEN = "hidden"
_EXTRA = "x."  # prefix of extra tensors' names inside a file
_CHECKSUM = "crc32."  # header metadata: crc32.<tensor name> = the CRC-32 of that tensor's bytes


class CorruptEntryFile(ValueError):
    """An entry file whose header is intact but whose tensors' bytes do not match their checksums."""


def checksum(tensor: Tensor) -> str:
    """The CRC-32 of ``tensor``'s bytes as a file stores them (8 hex digits).

    CRC-32 because it is the cheapest stdlib hash that catches what happens to files (any burst
    of up to 32 flipped bits, any overwritten run with probability 1 - 2**-32): ~2 GB/s, ~45 us
    for a 96 KiB activation, against ~5x that for BLAKE2b (``benchmarks/cache_store``). It is
    not a defence against someone who can write the directory (0700): they could write any file.
    """
    flat = tensor.detach().contiguous().reshape(-1)
    return f"{zlib.crc32(flat.view(torch.uint8).numpy()):08x}"


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: how a file's header (and a store folder's name) spell a dtype."""
    return str(dtype).removeprefix("torch.")


def key_of(name: str) -> str | None:
    """The key an entry file's name holds, or ``None`` for any other file (a temporary, a probe)."""
    if not name.endswith(SUFFIX):
        return None
    key = name[: -len(SUFFIX)]
    return key if KEY_PATTERN.match(key) else None


def check_keys(keys: Sequence[str]) -> None:
    """Keys become file names: each must be a key of :mod:`~lightning_pipetransformer.cache.keys`' shape."""
    for key in keys:
        if not isinstance(key, str) or not KEY_PATTERN.match(key):
            raise ValueError(
                f"Invalid cache key {key!r}: keys become file names; use content_keys() or index_keys()."
            )


def entry_path(directory: Path, key: str) -> Path:
    """Where the entry file of ``key`` is in a store's ``directory``."""
    return directory / f"{key}{SUFFIX}"


def header(fingerprint: str, boundary: int, key: str) -> dict[str, str]:
    """What a file's metadata says about where it belongs: written with every entry, matched on every read."""
    return {
        "format": _FORMAT,
        "version": str(FORMAT_VERSION),
        "fingerprint": fingerprint,
        "boundary": str(boundary),
        "key": key,
    }


def encode(where: Mapping[str, str], hidden: Tensor, original: torch.dtype, extras: Mapping[str, Tensor]) -> bytes:
    """The bytes of one entry file: ``hidden`` (in its storage dtype, ``original`` the activation's own) and
    ``extras``, under the header ``where`` (:func:`header`) and a checksum per tensor."""
    tensors = {_HIDDEN: hidden.contiguous(), **{_EXTRA + n: t.contiguous() for n, t in extras.items()}}
    metadata = {**where, "dtype": dtype_name(original), **{_CHECKSUM + name: checksum(t) for name, t in tensors.items()}}
    return safetensors_save(tensors, metadata=metadata)


def write_entry(directory: Path, key: str, data: bytes) -> None:
    """Write ``data`` as ``key``'s file in ``directory``: a unique temporary name, then ``os.replace``."""
    tmp = directory / f".{key}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, entry_path(directory, key))  # atomic: readers see the old file, the new one, or none
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_entry(path: Path, where: Mapping[str, str], with_extras: bool) -> tuple[Tensor, torch.dtype, dict[str, Tensor]]:
    """The activation (in its storage dtype), its original dtype and, ``with_extras``, the extra tensors of one file.

    Raises:
        CorruptEntryFile: a tensor's bytes do not match its checksum.
        Exception: anything else that makes the file unusable (missing, not safetensors, a header
            that does not match ``where``, an unknown dtype): the caller counts it a miss.
    """
    with safe_open(str(path), framework="pt", device="cpu") as f:
        meta = f.metadata() or {}
        if any(meta.get(k) != v for k, v in where.items()):
            raise ValueError(f"metadata {meta} does not match {dict(where)}")
        original = getattr(torch, meta.get("dtype", ""), None)
        if not isinstance(original, torch.dtype):
            raise ValueError(f"unknown dtype {meta.get('dtype')!r}")
        names = [_HIDDEN, *(n for n in f.keys() if n.startswith(_EXTRA))] if with_extras else [_HIDDEN]
        tensors = {n: f.get_tensor(n) for n in names}
    # The bytes this read returns are exactly the ones checked (the memory map is copied by get_tensor).
    if any(meta.get(_CHECKSUM + n) != checksum(t) for n, t in tensors.items()):
        raise CorruptEntryFile(f"{path}: a tensor's bytes do not match its checksum")
    extras = {n[len(_EXTRA) :]: t for n, t in tensors.items() if n != _HIDDEN}
    return tensors[_HIDDEN], original, extras
