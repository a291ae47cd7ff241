"""The FP8 GEMM (``gemm: fp8``, torch._scaled_mm) against the emulated one, on a device: one HiF8Linear at the
OpenPangu-Embedded-1B MLP shape (1536 -> 6144), gradients quantized so all three GEMMs run on FP8, under bf16
autocast on CUDA; prints the relative error of the forward output, dgrad and wgrad (the exact tail: only the
accumulation order differs; both round to bf16). benchmarks/gpu_validation.sh runs it on the GPU:

    python benchmarks/fp8_check.py --device cuda
"""

from __future__ import annotations

import argparse

import torch

from _common import int_options

from qat_app.config import QuantConfig
from qat_app.hif8.linear import HiF8Linear
from qat_app.hif8.training import sync_and_advance


def run(gemm: str, args) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    layer = HiF8Linear.from_linear(torch.nn.Linear(args.hidden, args.intermediate, device=args.device), **QuantConfig(
        gemm=gemm, fp8_tail=args.tail, quantize_grads=True, grad_stochastic_rounding=False, history_len=4,
        fused="off" if args.device == "cpu" else "auto").layer_options())
    x = torch.randn(args.batch, args.seq_len, args.hidden, device=args.device, requires_grad=True)
    for _ in range(2):  # the first step records the histories; the second runs every GEMM with delayed scales
        x.grad = layer.weight.grad = layer.bias.grad = None
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.device == "cuda"):
            out = layer(x)
        out.float().pow(2).mean().backward()
        sync_and_advance(layer)
    return out.detach().float(), x.grad.float(), layer.weight.grad.float()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    int_options(p, hidden=1536, intermediate=6144, batch=8, seq_len=1024)
    p.add_argument("--tail", default="exact")
    args = p.parse_args()
    emulated, fp8 = run("emulated", args), run("fp8", args)
    errors = [float((a - b).norm() / b.norm()) for a, b in zip(fp8, emulated)]
    print("fp8 vs emulated relative error (forward, dgrad, wgrad): " + " ".join(f"{e:.2e}" for e in errors))


if __name__ == "__main__":
    main()
