"""The one way every export is written, and what a format declares to be written that way.

:func:`write_export` is the skeleton: the source (:mod:`.source`: the model, its tokenizer, the dtypes, every
8-bit weight quantized once), an existing directory refused before any work (:class:`~.common.StagingDir`), the
format's checks and tensors (``prepare``), its files written into the staging directory (``save``) with the
inventory of what is quantized (from the source), then the rename into place. A format is one
:class:`ExportFormat`; :mod:`.formats` lists them for the command line.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .common import StagingDir, save_inventory
from .source import export_source


def _no_options(args: argparse.Namespace) -> dict:
    return {}


def _always(options: dict) -> bool:
    return True


@dataclass(frozen=True)
class ExportFormat:
    """One kind of export: how it is prepared and saved, and what the command line says and asks of it."""

    name: str  # what --format names
    marker: str  # the file that marks a directory as an export of this kind (all --overwrite may replace)
    prepare: Callable[..., Callable[[Path], Any]]  # (source, **options) -> save(directory) -> the report
    summary: Callable[[Any, Any], str]  # (the directory, the report) -> the command line's one line
    run_dtype: bool = True  # the unquantized tensors default to the dtype the run computed in (else: unchanged)
    options: Callable[[argparse.Namespace], dict] = _no_options  # this format's own options, from the command line
    computes_codes: Callable[[dict], bool] = _always  # whether these options write the weights' 8-bit codes
    dtype_field: str = "model.dtype"  # the setting a bad dtype is named by
    compute_dtype_field: str = "model.dtype"


def write_export(fmt: ExportFormat, module_or_model, out_dir: str | os.PathLike, *,
                 dtype: str | torch.dtype | None = None, compute_dtype: str | torch.dtype | None = None,
                 tokenizer=None, overwrite: bool = False, **options) -> Any:
    """Write ``module_or_model`` (a QATModule or a patched HF model, not modified) as ``fmt`` into ``out_dir`` ->
    the format's report. ``overwrite`` replaces only an earlier export of this kind."""
    source = export_source(module_or_model, tokenizer, dtype, compute_dtype, dtype_field=fmt.dtype_field,
                           compute_dtype_field=fmt.compute_dtype_field)
    staging = StagingDir(out_dir, overwrite, fmt.marker)  # refuse an existing run or export before any work
    save = fmt.prepare(source, **options)
    with staging as directory:
        report = save(directory)
        save_inventory(source, directory)
    return report
