"""``python main.py export ...`` / ``python -m qat_app.export ...``: a QATModule checkpoint -> an export."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from ..errors import QATError
from ..hif8.inventory import INVENTORY_FILE, inventory_summary
from .hf import export_hf
from .layout import checkpoint_bytes
from .qat_checkpoint import load_qat_checkpoint
from .writer import export_hif8


def main(argv: list[str] | None = None, prog: str = "python -m qat_app.export") -> int:
    """CLI; returns the exit status (2, with one ``error: ...`` line, for bad input)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Export a QATModule Lightning checkpoint as an 8-bit HiF8 checkpoint or a plain HF directory.",
    )
    parser.add_argument("--ckpt", required=True, help="Lightning checkpoint (.ckpt) of a QATModule")
    parser.add_argument("--out", required=True, help="output directory (must not exist or be empty, unless --overwrite)")
    parser.add_argument("--format", choices=("hif8", "hf"), default="hif8")
    parser.add_argument("--dtype", default=None,
                        help="hif8: storage dtype of the unquantized tensors (default bfloat16); hf: parameter dtype (default unchanged)")
    parser.add_argument("--compute-dtype", default=None,
                        help="dtype the quantized linears ran in (default: the weights'; bfloat16 for bf16-mixed training)")
    parser.add_argument("--hf-weights", choices=("master", "quantized"), default="master",
                        help="hf: trained high-precision weights, or the fake-quantized 8-bit-grid weights")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing export directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        from qat_app.models import resolve_dtype

        for flag, value in (("--dtype", args.dtype), ("--compute-dtype", args.compute_dtype)):
            if value is not None:
                resolve_dtype(value, field=flag)
        if Path(args.out).exists() and Path(args.out).is_dir() and any(Path(args.out).iterdir()) and not args.overwrite:
            raise FileExistsError(f"{args.out} already exists and is not empty; pass --overwrite to replace it")
        module = load_qat_checkpoint(args.ckpt)
        if args.format == "hif8":
            layout = export_hif8(module, args.out, dtype=args.dtype or "bfloat16", compute_dtype=args.compute_dtype,
                                 overwrite=args.overwrite)
            print(f"wrote {args.out}: {len(layout['quantized_layers'])} HiF8 layers, "
                  f"{layout['weights_file_bytes'] / 2**20:.1f} MiB ({layout['bytes']['codes'] / 2**20:.1f} MiB of codes)")
        else:
            export_hf(module, args.out, weights=args.hf_weights, dtype=args.dtype, compute_dtype=args.compute_dtype,
                      overwrite=args.overwrite)
            print(f"wrote {args.out}: {checkpoint_bytes(args.out) / 2**20:.1f} MiB")
        inventory = Path(args.out) / INVENTORY_FILE
        if inventory.is_file():
            print(f"{inventory_summary(json.loads(inventory.read_text()))} [{inventory}]")
    except (QATError, FileNotFoundError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
