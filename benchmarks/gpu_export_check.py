"""A run's exports hold the codes its training forward computes: ``main.py export`` as ``--format hif8`` and
``--format compressed-tensors`` with the defaults, then every quantized weight's codes as the training forward
computes them (the weight in the run's compute dtype, its scaler's scale, the fake-quant backend the run used on
``--device``: the Triton kernel on CUDA) against the codes in both exports (FP8: the E4M3 values / 16, above the
tail). One line ``RESULT {json}``: codes compared and codes that differ per export (0 is the pass).

    python benchmarks/gpu_export_check.py --ckpt_path RUN/checkpoints/last.ckpt --device cuda --out $OUT/export
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.gpu_fit_check import run_main  # noqa: E402


def export(ckpt: str, out: Path, fmt: str) -> int:
    return run_main(["export", "--ckpt_path", ckpt, "--out", str(out), "--format", fmt, "--overwrite"],
                    out.with_suffix(".log"), mode="w")


def main(argv: list[str] | None = None) -> int:
    from safetensors.torch import load_file

    from qat_app.export.layout import WEIGHTS_FILE
    from qat_app.export.qat_checkpoint import load_qat_checkpoint, run_compute_dtype
    from qat_app.hif8.formats import hif8_decode
    from qat_app.hif8.linear import HiF8Linear

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt_path", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu_export_"))
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"return_codes": {fmt: export(args.ckpt_path, out / fmt, fmt) for fmt in ("hif8", "compressed-tensors")}}
    module = load_qat_checkpoint(args.ckpt_path)
    dtype_name, _ = run_compute_dtype(module)
    compute = getattr(torch, dtype_name) if dtype_name else None
    result["compute_dtype"] = dtype_name
    hif8 = load_file(str(out / "hif8" / WEIGHTS_FILE)) if result["return_codes"]["hif8"] == 0 else {}
    fp8 = ({k: v for f in (out / "compressed-tensors").glob("*.safetensors") for k, v in load_file(str(f)).items()}
           if result["return_codes"]["compressed-tensors"] == 0 else {})
    compared = differ_hif8 = differ_fp8 = 0
    for name, layer in module.named_modules():
        if not isinstance(layer, HiF8Linear) or not layer.quantize_weights:
            continue
        name = name.removeprefix("model.")
        layer.to(args.device)
        weight = layer.weight.detach().to(compute or layer.weight.dtype)
        trained, _ = layer.weight_scaler.quantize(weight, layer.format, want_codes=True, fused=layer.runtime.fused)
        codes = trained.codes.cpu()
        compared += codes.numel()
        exported = hif8.get(f"{name}.weight.codes")
        differ_hif8 += codes.numel() if exported is None else int((exported != codes).sum())
        served = fp8.get(f"{name}.weight")
        grid = hif8_decode(codes)
        exact = grid.abs() >= 2.0**-12  # E4M3 holds grid x 16 exactly above the tail
        differ_fp8 += int(exact.sum()) if served is None else int((served.float()[exact] / 16 != grid[exact]).sum())
        layer.to("cpu")
    result.update(codes=compared, differ_hif8=differ_hif8, differ_fp8=differ_fp8)
    print("RESULT " + json.dumps(result))
    return 0 if compared and differ_hif8 == differ_fp8 == 0 and not any(result["return_codes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
