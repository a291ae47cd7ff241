"""Fake-quantization throughput against a plain clone() of the same tensor, in the same process.

Measures the whole per-tensor step the quantized linear runs (scale, clip, round to HiF8,
dequantize, amax, saturation count) on a 64M-element tensor in bf16 and fp32, for the plain-torch
reference and the fused (torch.compile) kernel, and prints elements/s and the ratio to clone();
also the fused kernel writing the uint8 codes (``fused+codes``) and decoding codes back to values
(``decode``), the two calls behind 8-bit saved activations.
Targets: fused within 4x of clone() on a CPU, within 1.5x on a GPU.

On CUDA, ``fused`` for HiF8 dispatches to the hand-written Triton kernel when triton is installed;
``--triton`` (CUDA only) also times that kernel directly (``triton``, and ``triton+codes`` with the
uint8 codes written too) and the torch.compile build of the reference (``inductor``) for comparison.

    python benchmarks/quantize_throughput.py [--numel 67108864] [--device cuda] [--repeats 5] [--triton]
"""

from __future__ import annotations

import argparse

import torch

from _common import seconds

from qat_app.hif8.backends.compiled import CompiledBackend
from qat_app.hif8.fake_quant import dequantize_codes, fake_quantize


def timed(fn, device: str, repeats: int) -> float:
    fn()  # warm-up (and compilation)
    return min((seconds(fn, device) for _ in range(repeats)), default=float("inf"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=64 * 1024 * 1024)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-eager", action="store_true", help="skip the slow plain-torch reference")
    parser.add_argument("--triton", action="store_true", help="CUDA: also time the Triton kernel and torch.compile")
    args = parser.parse_args()
    device = args.device
    print(f"device={device} ({torch.cuda.get_device_name() if device == 'cuda' else f'{torch.get_num_threads()} CPU threads'}), "
          f"numel={args.numel:,}, torch {torch.__version__}")
    print(f"{'dtype':>9} {'path':>12} {'seconds':>9} {'Gelem/s':>9} {'x clone':>8}")
    for dtype in (torch.bfloat16, torch.float32):
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(args.numel, device=device, dtype=dtype, generator=gen) * 3
        scale = torch.tensor(2.0, device=device)
        base = timed(lambda: x.clone(), device, args.repeats)
        print(f"{str(dtype)[6:]:>9} {'clone':>12} {base:9.4f} {args.numel / base / 1e9:9.2f} {1.0:8.2f}")
        paths = [("fused", "on")] + ([] if args.skip_eager else [("plain", "off")])
        runs = [(label, lambda fused=fused: fake_quantize(x, scale, 15.0, fused=fused)) for label, fused in paths]
        # what the quantized linear runs per step: quantize with the uint8 codes, decode them for backward
        codes = fake_quantize(x, scale, 15.0, want_codes=True, fused="on").codes
        runs.append(("fused+codes", lambda: fake_quantize(x, scale, 15.0, want_codes=True, fused="on")))
        runs.append(("decode", lambda: dequantize_codes(codes, scale, "hif8", dtype, fused="on")))
        # the emulated GEMM's operands: the grid values themselves (with the codes kept for backward), decoded back
        runs.append(("grid+codes", lambda: fake_quantize(x, scale, 15.0, want_codes=True, fused="on", grid=True)))
        runs.append(("decode grid", lambda: dequantize_codes(codes, None, "hif8", dtype, fused="on")))
        if args.triton and device == "cuda":
            from qat_app.hif8.backends.triton import fake_quantize_triton, supports

            if supports("hif8", x, scale):
                runs.append(("triton", lambda: fake_quantize_triton(x, scale, 15.0)))
                runs.append(("triton+codes", lambda: fake_quantize_triton(x, scale, 15.0, want_codes=True)))
            else:
                print("  (triton not available: pip install triton)")
            inductor = CompiledBackend(required=True)
            runs.append(("inductor", lambda: inductor.quantize(x, scale, 15.0, 15.5, "hif8", False, None)))
        for label, fn in runs:
            t = timed(fn, device, args.repeats)
            print(f"{str(dtype)[6:]:>9} {label:>12} {t:9.4f} {args.numel / t / 1e9:9.2f} {t / base:8.2f}")


if __name__ == "__main__":
    main()
