"""Sharded (FSDP2, torch.distributed.checkpoint) checkpoint directories: complete or not, read whole on one process.

A directory is complete when DCP's ``.metadata``, every shard file it lists (with its bytes) and Lightning's
``meta.pt`` are there (:func:`sharded_metadata`: one line naming what is missing otherwise). It is read with DCP's
own single-process reader (:func:`read_sharded_checkpoint`), its pickled parts as data. ``validate`` / ``test`` of
one under a strategy that reads files go through :class:`ShardedCheckpointIO`.
"""

from __future__ import annotations

import enum
import importlib
import io
import os
import pickle
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO

from .errors import CheckpointError, UnsafeFileError
from .safe_load import listed, torch_load, unsafe_file_error

def is_sharded_checkpoint(path: str) -> bool:
    """A distributed checkpoint directory (FSDP2 / ModelParallelStrategy): DCP's ``.metadata`` inside."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, ".metadata"))


def looks_sharded(path: str) -> bool:
    """A directory a distributed checkpoint was (or was being) written to: DCP's ``.metadata`` or shard files
    (``*.distcp``) inside; one without ``.metadata`` is incomplete (:func:`sharded_metadata` says so)."""
    return is_sharded_checkpoint(path) or (os.path.isdir(path) and any(f.endswith(".distcp") for f in os.listdir(path)))


def _enum_member(cls, name: str):
    """``getattr(cls, name)`` only where ``cls`` is an enum the unpickler allowed: the member named, nothing else."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"Weights only load failed: GLOBAL builtins.getattr on {cls!r}.{name!r}")


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a plain pickle: read as data, like every checkpoint here. It may name DCP's own
    classes, torch dtypes / ``Size`` / layouts and ``pathlib`` paths; anything else is refused."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("builtins", "getattr"):
            return _enum_member  # how some Pythons (3.11.2, Debian 12's) pickle an enum member: getattr(cls, name)
        dcp = module.startswith("torch.distributed.checkpoint.")
        known = "." not in name and (dcp or module in ("torch", "torch.serialization", "pathlib"))
        found = getattr(importlib.import_module(module), name, None) if known else None
        torch_value = (torch.dtype, torch.layout, torch.memory_format)
        allowed = (
            (dcp and isinstance(found, type) and found.__module__ == module)  # DCP's own classes, not what they import
            or (module == "torch" and (found is torch.Size or isinstance(found, torch_value)))
            or (module, name) == ("torch.serialization", "_get_layout")
            or (module == "pathlib" and name.endswith("Path")))
        if not allowed:
            raise pickle.UnpicklingError(f"Weights only load failed: GLOBAL {module}.{name}")
        return found


def sharded_metadata(path: str, weights_only: bool | None = None):
    """DCP's metadata of a complete sharded checkpoint directory (read as data unless ``weights_only is False``).

    :class:`CheckpointError` in one line naming the directory and what is missing -- ``.metadata`` (written after
    the shards, by rank 0), a shard file it lists or its bytes, Lightning's ``meta.pt`` (hyper-parameters, loop
    state, written last) -- as a job that died while saving, or a copy made in part, leaves it; nothing in the
    directory is changed."""
    from torch.distributed.checkpoint import FileSystemReader

    shards = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointError(
            f"sharded checkpoint {path} is incomplete: .metadata is missing (DCP's index of the shard files, written "
            f"after them; {len(shards)} shard file(s) are there): the job died while saving it, or it was copied in "
            f"part. {_SHARDED_REMEDY}")
    try:
        if weights_only is not False:
            with open(os.path.join(path, ".metadata"), "rb") as f:
                _MetadataUnpickler(f).load()
        metadata = FileSystemReader(path).read_metadata()
        needed: dict[str, int] = {}
        for info in metadata.storage_data.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    except Exception as err:
        if isinstance(err, pickle.UnpicklingError) and "Weights only load failed" in str(err):
            raise unsafe_file_error(os.path.join(path, ".metadata"), err) from None
        raise _unreadable(path, ".metadata", err) from err
    missing = [f for f in sorted(needed) if not os.path.isfile(os.path.join(path, f))]
    short = [f"{f} ({os.path.getsize(os.path.join(path, f)):,} of {size:,} bytes)" for f, size in sorted(needed.items())
             if f not in missing and os.path.getsize(os.path.join(path, f)) < size]
    what = ([f"missing {listed(missing)} ({len(missing)} of the {len(needed)} shard files its .metadata lists)"]
            if missing else []) + ([f"truncated {listed(short)}"] if short else [])
    if not os.path.isfile(os.path.join(path, LIGHTNING_META_FILE)):
        what.append(f"missing {LIGHTNING_META_FILE} (Lightning's hyper-parameters and loop state, written last)")
    if what:
        raise CheckpointError(f"sharded checkpoint {path} is incomplete: {'; '.join(what)}: the job died while saving "
                              f"it, or it was copied in part. {_SHARDED_REMEDY}")
    return metadata


LIGHTNING_META_FILE = "meta.pt"  # lightning.fabric.utilities.load._METADATA_FILENAME
_SHARDED_REMEDY = "Nothing in it was changed: copy the missing files, or use an earlier checkpoint of the run."


def _unreadable(path: str, what: str, err: BaseException) -> CheckpointError:
    first = (str(err).strip().splitlines() or [""])[0]
    return CheckpointError(f"sharded checkpoint {path} cannot be read ({what}: {type(err).__name__}: {first}); it is "
                           f"incomplete (the job died while writing it?) or corrupt. {_SHARDED_REMEDY}")


def read_sharded_shapes(path: str, weights_only: bool | None) -> dict[str, Any]:
    """The checkpoint's non-tensor part (Lightning's ``meta.pt``) plus its state_dict as empty tensors of the
    saved shapes (from DCP's metadata): enough to check it against the model without loading a tensor (its
    pickled entries are read, as data). (:func:`read_checkpoint` reads the whole of it.)"""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    metadata = sharded_metadata(path, weights_only)
    ckpt = _sharded_meta(path, weights_only)
    if weights_only is not False:  # what DCP pickled (read back unrestricted by a resume): checked as data first
        _read_entries(path, weights_only, {key for key, md in metadata.state_dict_metadata.items()
                                           if isinstance(md, BytesStorageMetadata)})
    ckpt["state_dict"] = {}
    for key, md in metadata.state_dict_metadata.items():
        if not key.startswith("state_dict."):
            continue
        key = key[len("state_dict."):]
        if "._extra_state." in key:  # DCP flattens a module's extra state (a dict): present, without a shape
            ckpt["state_dict"][key.split("._extra_state.", 1)[0] + "._extra_state"] = None
        else:
            ckpt["state_dict"][key] = torch.empty(tuple(md.size), device="meta") if isinstance(md, TensorStorageMetadata) else None
    if any(key.startswith("optimizer_0") for key in metadata.state_dict_metadata):
        ckpt.setdefault("optimizer_states", [None])
    return ckpt


def _sharded_meta(path: str, weights_only: bool | None) -> dict[str, Any]:
    try:
        ckpt = torch_load(os.path.join(path, LIGHTNING_META_FILE), weights_only)
    except UnsafeFileError:
        raise
    except Exception as err:
        raise _unreadable(path, LIGHTNING_META_FILE, err) from err
    return dict(ckpt) if isinstance(ckpt, dict) else {}


def sharded_hparams(path: str, weights_only: bool | None = None) -> dict | None:
    """The hyper-parameters a sharded checkpoint directory's ``meta.pt`` holds (what Lightning's CLI reads from a
    file's: ``validate`` / ``test`` evaluate the saved model)."""
    return _sharded_meta(path, weights_only).get("hyper_parameters")


def read_sharded_checkpoint(path: str, weights_only: bool | None = None, optimizer: bool = False,
                            select=None) -> dict[str, Any]:
    """A sharded checkpoint directory read whole on this process, as Lightning's single-file checkpoint holds it:
    ``meta.pt`` plus the full (unsharded) ``state_dict`` on CPU -- every weight, scaler buffer and quantized
    layer's extra state (its switches and fallback decisions) -- and, with ``optimizer``, the optimizer state.

    DCP's own single-process reader (``dcp_to_torch_save``'s and Lightning's ``_load_distributed_checkpoint``'s):
    any number of saving ranks, into host memory. Its pickled parts (``.metadata``, the extra state) are read as
    data unless ``weights_only is False``. ``select``: only the state-dict entries whose key it accepts (a check
    that needs a few reads only those). :class:`CheckpointError` (one line) for an incomplete directory."""
    metadata = sharded_metadata(path, weights_only)
    ckpt = _sharded_meta(path, weights_only)
    ckpt.update(_read_entries(path, weights_only, {
        key for key in metadata.state_dict_metadata
        if (key.startswith("state_dict.") and (select is None or select(key[len("state_dict."):])))
        or (optimizer and not key.startswith("state_dict."))}))
    ckpt.setdefault("state_dict", {})
    return ckpt


def _read_entries(path: str, weights_only: bool | None, keys: set[str]) -> dict[str, Any]:
    """The entries ``keys`` (DCP's flat names) of a complete sharded checkpoint, nested as they were saved; what
    DCP pickled (a module's extra state, the optimizer's hyper-parameters) read as data unless ``weights_only
    is False`` (:class:`UnsafeFileError` naming the entry)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    class Planner(_EmptyStateDictLoadPlanner):
        def load_bytes(self, read_item, value) -> None:  # DCP unpickles these with weights_only=False
            data = value.read()
            if weights_only is not False:
                try:
                    torch.load(io.BytesIO(data), weights_only=True)
                except pickle.UnpicklingError as err:
                    raise unsafe_file_error(f"{path} ({read_item.dest_index.fqn})", err) from None
            super().load_bytes(read_item, io.BytesIO(data))

    state: dict[str, Any] = {}
    if not keys:
        return state
    try:
        _load_state_dict(state, storage_reader=FileSystemReader(path), planner=Planner(keys=keys), no_dist=True)
    except CheckpointException as err:  # DCP's wrapper of what failed (a BaseException): the cause, in one line
        cause = next(iter(err.failures.values()))[0]
        if isinstance(cause, UnsafeFileError):
            raise cause from None
        raise _unreadable(path, "a shard file", cause) from cause  # there, long enough, not what .metadata says
    return state


class ShardedCheckpointIO(CheckpointIO):
    """A strategy's checkpoint IO that also reads a sharded checkpoint directory (:func:`read_checkpoint`):
    ``validate`` / ``test`` of an FSDP2 run's checkpoint on one device or under DDP. Everything else is the
    wrapped IO's."""

    def __init__(self, inner: CheckpointIO) -> None:
        self.inner = inner

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict[str, Any]:
        if looks_sharded(str(path)):
            return read_sharded_checkpoint(str(path), weights_only)
        return self.inner.load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def remove_checkpoint(self, path) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()


def read_sharded_with(trainer, path: str, need_training_state: bool) -> None:
    """Let ``trainer`` load the sharded checkpoint directory ``path``: a strategy that reads them (FSDP2's
    ModelParallelStrategy, FSDPStrategy) does so itself, resharding to its devices; under any other, an
    evaluation reads it whole (:class:`ShardedCheckpointIO`) and a resume is refused (its optimizer state is
    the sharded strategy's)."""
    from lightning.pytorch.strategies import Strategy

    strategy = trainer.strategy
    if type(strategy).load_checkpoint is not Strategy.load_checkpoint:
        return
    if need_training_state:
        raise CheckpointError(
            f"checkpoint {path} is a sharded (FSDP2) checkpoint directory: a fit resumes it under the strategy that "
            f"wrote it (trainer.strategy: ModelParallelStrategy, as in configs/exp8_fsdp.yaml), not "
            f"{type(strategy).__name__}; validate, test, inspect and export read it as it is")
    if not isinstance(strategy.checkpoint_io, ShardedCheckpointIO):
        strategy.checkpoint_io = ShardedCheckpointIO(strategy.checkpoint_io)
