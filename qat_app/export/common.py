"""What the exports share besides their source (:mod:`.source`): the layers' recipe, the staging directory, the
files saved beside the weights."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from ..config import QuantConfig
from ..hif8.inventory import INVENTORY_FILE, quantization_inventory
from ..hif8.linear import HiF8Linear
from .layout import ExportError

log = logging.getLogger("qat_app.export")


def quant_of(model: nn.Module, layers: list[tuple[str, HiF8Linear]]) -> QuantConfig:
    """The layers' common recipe and runtime options, as the flat QuantConfig the layout records."""
    first = layers[0][1]
    for name, layer in layers[1:]:
        if (layer.recipe, layer.runtime) != (first.recipe, first.runtime):
            raise ExportError(f"layer {name} has a different recipe than {layers[0][0]}: mixed recipes are not supported")
    return QuantConfig.from_layer_options(first.recipe, first.runtime)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN == NaN, same shape and dtype."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    return bool(torch.equal(nan_a, nan_b) and torch.equal(a[~nan_a], b[~nan_b]))


# what a run directory holds: an export never replaces a directory with any of these in it
_RUN_FILES = ("*.ckpt", "metrics.csv", "hparams.yaml", "config.yaml", "events.out.tfevents.*")


class StagingDir:
    """Write into a temporary sibling of ``out_dir`` and rename it into place on success.

    ``overwrite`` replaces only an earlier export of the same kind (its ``marker`` file at the top, nothing
    of a run inside): a run directory, another kind of export or any other directory is refused, so
    ``--overwrite`` pointed at the wrong place cannot delete checkpoints or logs."""

    def __init__(self, out_dir: str | os.PathLike, overwrite: bool, marker: str) -> None:
        self.target = Path(out_dir).expanduser().absolute()
        if self.target.exists():
            if not self.target.is_dir():
                raise FileExistsError(f"{self.target} exists and is not a directory")
            if any(self.target.iterdir()) and not overwrite:
                raise FileExistsError(f"{self.target} already exists and is not empty; pass --overwrite (overwrite=True) to replace it")
            if any(self.target.iterdir()):
                run_files = [str(p.relative_to(self.target)) for pattern in _RUN_FILES for p in self.target.rglob(pattern)]
                if run_files or not (self.target / marker).is_file():
                    why = (f"it holds files of a run ({', '.join(sorted(run_files)[:3])})" if run_files
                           else f"it is not an export of this kind (no {marker})")
                    raise FileExistsError(
                        f"{self.target}: --overwrite only replaces an earlier export, and {why}; "
                        "choose another --out directory")
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.path: Path | None = None

    def __enter__(self) -> Path:
        self.path = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.tmp-", dir=str(self.target.parent)))
        return self.path

    def __exit__(self, exc_type, exc, tb) -> None:
        assert self.path is not None
        if exc_type is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self.path, 0o777 & ~umask)
        old = None
        if self.target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{self.target.name}.old-", dir=str(self.target.parent)))
            os.rename(self.target, old / "x")
        os.rename(self.path, self.target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def save_inventory(source, directory: Path) -> dict | None:
    """``quantized_modules.json`` (:mod:`qat_app.hif8.inventory`) of an export source's model (:mod:`.source`): what
    the export holds in 8 bits and why the rest is not; None (nothing written) for a bare model, whose layer
    selection is not known."""
    if source.selection is None:
        return None
    inventory = quantization_inventory(source.model, source.selection)
    (Path(directory) / INVENTORY_FILE).write_text(json.dumps(inventory, indent=1))
    return inventory


def save_model_files(model: nn.Module, tokenizer, directory: Path) -> None:
    """config.json, generation_config.json, remote code, tokenizer (no weights)."""
    model.config.save_pretrained(str(directory))
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        try:
            generation_config.save_pretrained(str(directory))
        except Exception as err:  # pragma: no cover - an invalid generation config must not stop the export
            log.warning("generation_config not saved: %s", err)
    if getattr(model, "_auto_class", None) is not None:  # trust_remote_code models: copy their code
        from transformers.dynamic_module_utils import custom_object_save

        custom_object_save(model, str(directory), config=model.config)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
