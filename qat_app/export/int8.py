"""INT8 weights for the CPU serve target (``--serve_target cpu``): each row of a HiF8 weight's grid written as int8
times a power of two, so that every grid value that int8 can hold at that row's resolution is written exactly.

A HiF8 weight is ``grid / s`` with ``|grid| <= max_val`` (15). Row ``r`` is written as ``round(grid x 2^k_r)`` with
the largest ``k_r`` that keeps the row's largest ``|grid|`` within 127, and the per-channel scale
``2^-k_r / s`` (float64, rounded once to float32). For a row reaching 15, ``k = 3``: every grid value of magnitude
>= 1 (HiF8's tiers of 3 mantissa bits at exponents 0..3 are multiples of 1/8) is exact, and the values under 1 are
rounded to the nearest 1/8 (at most 1/16 of a grid unit, 0.42% of the range). The report gives, per layer, how
many values were rounded and by how much. vLLM serves these layers with its oneDNN int8 kernel (weights prepacked
at load, per-token int8 inputs at ``amax / 127``; compressed-tensors' emulation steps at ``amax / 127.5``), on every
x86-64 CPU. See ``docs/serving-cpu.md``.
"""

from __future__ import annotations

from collections import Counter

import torch

from ..hif8.fake_quant import dequantize_codes
from ..hif8.linear import HiF8Linear
from .source import WeightCodes

INT8_MAX = 127
MAX_SHIFT = 30  # an all-zero row: any power of two holds it; this one keeps the scale a normal float32


def row_shifts(grid: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` grid values -> ``[N]`` exponents ``k``: the largest with ``max |row| x 2^k <= 127``."""
    amax = grid.abs().amax(1).double()
    k = torch.floor(torch.log2(INT8_MAX / amax.clamp_min(2.0**-MAX_SHIFT)))
    return k.clamp(max=MAX_SHIFT)


def int8_weight(name: str, layer: HiF8Linear, weight: WeightCodes) -> tuple[dict[str, torch.Tensor], dict]:
    """One linear's int8 weight and per-channel scale from its HiF8 ``weight`` (+ the report's figures, and the
    reference the written weight must dequantize to)."""
    fmt, max_val = layer.format, layer.weight_scaler.max_val
    codes, scale = weight.codes, weight.scale
    grid = fmt.decode(codes).float()
    k = row_shifts(grid)
    shift = torch.pow(2.0, k).float()[:, None]
    shifted = grid * shift  # exact: a power of two
    q = torch.round(shifted).clamp(-INT8_MAX, INT8_MAX)
    exact = q == shifted
    decode_scale = torch.reciprocal(scale.double() * torch.pow(2.0, k)).float()[:, None]
    hif8 = dequantize_codes(codes, scale, fmt, torch.float32).cpu()
    served = (q * decode_scale).cpu()  # what compressed-tensors dequantizes the written tensors to
    error = (served - hif8).abs()
    rounded = int((~exact).sum())
    record = {
        "elements": grid.numel(),
        "rounded": rounded,
        "max_error": float(error.max()) if rounded else 0.0,
        "max_error_relative_to_range": float(error.max() * scale / max_val) if rounded else 0.0,
        "rms_error_relative_to_range": float(error.square().mean().sqrt() * scale / max_val),
        "hif8_weight_scale": float(scale),
        "row_shifts": sorted({int(v) for v in k.tolist()}),
    }
    tensors = {f"{name}.weight": q.to(torch.int8).cpu(), f"{name}.weight_scale": decode_scale.contiguous().cpu()}
    return tensors, {"record": record, "exact": torch.ones_like(exact, device="cpu"), "reference": served}



def int8_totals(schemes: dict[str, str], records: dict) -> dict:
    """The report's totals for an int8 export (its ``floor`` entry says what is rounded)."""
    return {
        "floor": "each row's grid values are written on a step of 2^-k grid units (the largest k that keeps the row "
                 "within 127): exact on that step (k = 3 for a row reaching 15: every value >= 1), rounded to it "
                 "below",
        "totals": {
            "int8_layers": len(records),
            "int8_elements": sum(r["elements"] for r in records.values()),
            "rounded": sum(r["rounded"] for r in records.values()),
            "max_error_relative_to_range": max((r["max_error_relative_to_range"] for r in records.values()),
                                               default=0.0),
            "schemes": dict(Counter(schemes.values())),
        },
    }


def int8_summary(out_dir, report: dict) -> str:
    """One line of what an int8 export holds (the CLI prints it)."""
    totals, size = report["totals"], report["bytes"]
    kept = (f", {len(report['ignored'])} quantized modules kept in {report['storage_dtype']}" if report["ignored"]
            else "")
    return (f"wrote {out_dir}: {totals['int8_layers']} linears in int8 (serve target cpu: per-token int8 inputs){kept}; "
            f"{size['weights'] / 2**20:.1f} MiB vs {size['bf16_weights'] / 2**20:.1f} MiB in BF16 "
            f"({size['weights'] / size['bf16_weights']:.3f}x); {totals['rounded']} of {totals['int8_elements']} weights "
            f"rounded from the HiF8 grid (largest error {totals['max_error_relative_to_range']:.3g} of the range)")
