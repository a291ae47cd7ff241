"""A run's exports hold the codes its training forward computes: ``main.py export`` as ``--format hif8`` and
``--format compressed-tensors`` with the defaults, then every quantized weight's codes as the training forward
computes them (the weight in the run's compute dtype, its scaler's scale, the fake-quant backend the run used on
``--device``: the Triton kernel on CUDA) against the codes in both exports (FP8: the E4M3 values / 16, above the
tail). One line ``RESULT {json}``: codes compared and codes that differ per export (0 is the pass). ``--ckpt_path``:
a checkpoint file or a sharded (FSDP2) checkpoint directory.

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


def training_codes(module, device=None, compute: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every quantized weight's uint8 codes as the training forward computes them -> {its name in the exports: codes on
    the CPU}: the weight in ``compute`` (None: its own dtype), its scaler's scale, the fake-quant backend the run used,
    on ``device`` (None: where the layer is). A live FSDP2 model's sharded weight is gathered whole (``full_tensor``, a
    collective: every rank calls this)."""
    from qat_app.hif8.linear import HiF8Linear
    from qat_app.hif8.operand import Operand

    codes = {}
    for name, layer in module.named_modules():
        if not isinstance(layer, HiF8Linear) or not layer.quantizes(Operand.WEIGHT):
            continue
        home = layer.weight.device
        if device is not None:
            layer.to(device)
        weight = layer.weight.detach()
        weight = weight.full_tensor() if hasattr(weight, "full_tensor") else weight
        weight = weight.to(compute or weight.dtype)
        trained, _ = layer.weight_scaler.quantize(weight, layer.format, want_codes=True, fused=layer.runtime.fused)
        codes[name.removeprefix("model.")] = trained.codes.cpu()
        if device is not None:
            layer.to(home)
    return codes


def differing_codes(codes: dict[str, torch.Tensor], hif8_dir: Path | None, fp8_dir: Path | None) -> dict:
    """``codes`` (:func:`training_codes`) against the codes in a ``--format hif8`` export and the E4M3 values / 16
    of a ``--format compressed-tensors`` one (above the tail, where E4M3 holds them exactly); a missing export or
    tensor counts every code as differing -> {"codes": compared, "differ_hif8": n, "differ_fp8": n}."""
    from safetensors.torch import load_file

    from qat_app.export.layout import WEIGHTS_FILE
    from qat_app.hif8.formats import hif8_decode

    hif8 = load_file(str(hif8_dir / WEIGHTS_FILE)) if hif8_dir is not None else {}
    fp8 = ({k: v for f in fp8_dir.glob("*.safetensors") for k, v in load_file(str(f)).items()}
           if fp8_dir is not None else {})
    compared = differ_hif8 = differ_fp8 = 0
    for name, trained in codes.items():
        compared += trained.numel()
        exported = hif8.get(f"{name}.weight.codes")
        differ_hif8 += trained.numel() if exported is None else int((exported != trained).sum())
        served = fp8.get(f"{name}.weight")
        grid = hif8_decode(trained)
        exact = grid.abs() >= 2.0**-12  # E4M3 holds grid x 16 exactly above the tail
        differ_fp8 += int(exact.sum()) if served is None else int((served.float()[exact] / 16 != grid[exact]).sum())
    return {"codes": compared, "differ_hif8": differ_hif8, "differ_fp8": differ_fp8}


def main(argv: list[str] | None = None) -> int:
    from qat_app.export.qat_checkpoint import load_qat_checkpoint, run_compute_dtype

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
    result["compute_dtype"] = dtype_name
    codes = training_codes(module, args.device, getattr(torch, dtype_name) if dtype_name else None)
    ok = {fmt: out / fmt if code == 0 else None for fmt, code in result["return_codes"].items()}
    result.update(differing_codes(codes, ok["hif8"], ok["compressed-tensors"]))
    print("RESULT " + json.dumps(result))
    return 0 if result["codes"] and result["differ_hif8"] == result["differ_fp8"] == 0 and not any(
        result["return_codes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
