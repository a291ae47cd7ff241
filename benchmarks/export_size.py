"""Size of the 8-bit HiF8 checkpoint (and of the FP8 serving export) vs a BF16 safetensors checkpoint of the same
model, and exact reload.

Loads a model (default: the embedded quickstart model), patches it with the quickstart's QuantConfig
(HiF8, max-window DTS, history 8, max_val 15, 5 high-precision boundary blocks), runs a few training-
mode forwards + ``advance()`` so every scaler has a history, then writes

  * a BF16 checkpoint: ``export_hf(..., dtype=bfloat16)`` (plain HF ``save_pretrained``),
  * the HiF8 checkpoint: ``export_hif8`` (uint8 codes + scalar scales for the quantized MLP weights,
    the rest in BF16),
  * the FP8 serving export: ``export_compressed_tensors`` (E4M3 weights + per-channel fp32 scales + input
    scales, the rest in BF16),

prints both sizes and the breakdown, reloads the HiF8 checkpoint with ``load_hif8`` and checks that
its logits equal the QAT model's on a batch (``torch.equal``). The QAT model runs in ``--dtype``
(default bfloat16, so its unquantized parameters are exactly what the BF16 storage holds).

    python benchmarks/export_size.py [--model embedded:smollm2-135m-instruct] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch

from _common import int_options

from qat_app.config import QuantConfig, quantize_model
from qat_app.export import checkpoint_bytes, export_compressed_tensors, export_hf, export_hif8, load_hif8
from qat_app.models import EMBEDDED_MODEL, load_causal_lm
from qat_app.hif8.scaling import all_scalers


def mib(n: int) -> str:
    return f"{n / 2**20:8.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=EMBEDDED_MODEL)
    parser.add_argument("--dtype", default="bfloat16", help="dtype of the QAT model (and of the unquantized storage)")
    parser.add_argument("--forwards", type=int, default=3, help="training-mode forwards (+ advance) to fill the scalers")
    int_options(parser, batch=2, seq_len=64)
    parser.add_argument("--out", default=None, help="directory for the two checkpoints (default: a temporary one, removed)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    t0 = time.perf_counter()
    model, tokenizer = load_causal_lm(args.model, dtype=args.dtype)
    quant = QuantConfig(enabled=True, format="hif8", amax_algo="max", history_len=8, max_val=15.0,
                        high_precision_layers=5, fused="off")
    report = quantize_model(model, quant)
    print(report.summary())
    text = ("The quick brown fox jumps over the lazy dog. Quantization-aware training keeps the model "
            "accurate in eight bits when the scales track the activations. ") * 8
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.seq_len].repeat(args.batch, 1)
    model.train()
    with torch.no_grad():
        for i in range(args.forwards):
            model(input_ids=torch.roll(ids, shifts=i, dims=1))
            for scaler in all_scalers(model):
                scaler.advance()
    model.eval()
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    print(f"model ready in {time.perf_counter() - t0:.1f} s")

    root = args.out or tempfile.mkdtemp(prefix="export_size-")
    try:
        bf16_dir, hif8_dir = os.path.join(root, "bf16"), os.path.join(root, "hif8")
        export_hf(model, bf16_dir, dtype="bfloat16", tokenizer=tokenizer, overwrite=True)
        layout = export_hif8(model, hif8_dir, dtype="bfloat16", tokenizer=tokenizer, overwrite=True)
        bf16_bytes, hif8_bytes = checkpoint_bytes(bf16_dir), checkpoint_bytes(hif8_dir)
        b = layout["bytes"]
        quantized_params = b["codes"]
        print()
        print(f"BF16 checkpoint (save_pretrained):   {mib(bf16_bytes)}  ({bf16_bytes} bytes)")
        print(f"HiF8 checkpoint (export_hif8):       {mib(hif8_bytes)}  ({hif8_bytes} bytes)  "
              f"= {hif8_bytes / bf16_bytes:.3f} x BF16")
        print(f"  quantized weights: {len(layout['quantized_layers'])} tensors, {quantized_params} params -> "
              f"{b['codes']} bytes of uint8 codes + {b['scales']} bytes of scales "
              f"({(b['codes'] + b['scales']) / quantized_params:.6f} bytes/param; BF16: 2)")
        print(f"  unquantized tensors in BF16:       {mib(b['dense'])}")
        print(f"  amax-scaler state (fp32/int64):    {b['scaler_state'] / 1024:8.1f} KiB")
        print(f"  safetensors header:                {hif8_bytes - sum(b.values())} bytes")

        fp8_dir = os.path.join(root, "fp8")
        fp8 = export_compressed_tensors(model, fp8_dir, dtype="bfloat16", tokenizer=tokenizer, overwrite=True)
        fp8_bytes = checkpoint_bytes(fp8_dir)
        print(f"FP8 export (compressed-tensors):     {mib(fp8_bytes)}  ({fp8_bytes} bytes)  "
              f"= {fp8_bytes / bf16_bytes:.3f} x BF16 (per-channel scales: 4 bytes per output row); "
              f"{fp8['totals']['below_floor']} of {fp8['totals']['fp8_elements']} weights below the E4M3 floor")

        t1 = time.perf_counter()
        loaded = load_hif8(hif8_dir)
        with torch.no_grad():
            logits = loaded(input_ids=ids).logits
        equal = torch.equal(logits, reference)
        print(f"\nreloaded in {time.perf_counter() - t1:.1f} s; logits {tuple(logits.shape)} {logits.dtype} "
              f"equal to the QAT model's: {equal} (max |diff| {(logits.float() - reference.float()).abs().max().item():.3g})")
        return 0 if equal else 1
    finally:
        if args.out is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
