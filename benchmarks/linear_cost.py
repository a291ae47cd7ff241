"""Kernels and bytes of one quantized linear's forward and backward against the same ``nn.Linear`` in BF16.

Counted with :class:`qat_app.hif8.kernel_count.KernelCounter` (every computing aten op one kernel; a compiled
fake-quant function, the Triton kernel and each GEMM one kernel with the bytes of its operands and result), so
the figures say what a GPU would launch and move, measured on any machine. The layer is in QAT after its warmup
(the exp8 recipe: ``max`` window H = 64, weights and activations quantized), under bf16 autocast (the GPU
recipe), at the openPangu-Embedded-1B MLP shape by default. Prints one table per GEMM mode; ``--json`` writes
the figures.

    python benchmarks/linear_cost.py                          # gate/up shape, 2048 tokens, emulated and fp8
    python benchmarks/linear_cost.py --in_features 6144 --out_features 1536 --tokens 8192
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torch import nn

from qat_app.hif8.gemm import GEMM_EMULATED, GEMM_FP8
from qat_app.hif8.kernel_count import KernelCount, KernelCounter
from qat_app.hif8.linear import HiF8Linear
from qat_app.hif8.quantized import set_health_measurement
from qat_app.hif8.recipe import HiF8Recipe, RuntimeOptions
from qat_app.hif8.training import end_warmup, start_warmup, sync_and_advance

PARTS = ("forward", "forward_later", "backward", "step")  # forward_later: a micro-batch after the step's first


def count_layer(layer: nn.Module, x: torch.Tensor, quantized: bool, health: bool = False) -> dict[str, KernelCount]:
    """The counts of one optimizer step of ``layer`` on two micro-batches of ``x`` (after two uncounted steps): the
    first micro-batch's forward (the weight is quantized there, once per step), a later one's, a backward, and the
    end of the step (QAT: :func:`sync_and_advance`)."""
    model = nn.ModuleList([layer])
    autocast = torch.autocast(x.device.type, dtype=torch.bfloat16)

    def micro_batch() -> tuple[KernelCount, KernelCount]:
        x_in = x.detach().requires_grad_()
        with KernelCounter() as forward:
            with autocast:
                out = layer(x_in)
        grad = torch.ones_like(out)
        with KernelCounter() as backward:
            out.backward(grad)
        return forward.count, backward.count

    def step() -> dict[str, KernelCount]:
        (forward, _), (forward_later, backward) = micro_batch(), micro_batch()
        with KernelCounter() as end:
            if quantized:
                sync_and_advance(model)
        layer.zero_grad(set_to_none=True)
        return dict(forward=forward, forward_later=forward_later, backward=backward, step=end.count)

    if quantized:
        start_warmup(model)
        step()
        end_warmup(model)
    step()  # compiles the kernels
    set_health_measurement(model, health)
    counts = step()
    set_health_measurement(model, False)
    return counts


def measure(args) -> dict[str, dict[str, dict]]:
    """Every variant's counts: ``{variant: {part: figures}}`` (:data:`PARTS`)."""
    torch.manual_seed(0)
    base = nn.Linear(args.in_features, args.out_features, bias=False)
    x = torch.randn(args.tokens, args.in_features)
    results = {"bf16": count_layer(base, x, quantized=False)}
    recipe = HiF8Recipe(amax_algo="max", history_len=64)
    for gemm in args.gemm:
        for health in (False, True):  # a fresh layer each: a plain step, then a logging step (health measured)
            layer = HiF8Linear.from_linear(nn.Linear(args.in_features, args.out_features, bias=False),
                                           recipe, RuntimeOptions(gemm=gemm))
            results[gemm + "+health" * health] = count_layer(layer, x, quantized=True, health=health)
    return {name: {part: count.as_dict() | {"by_name": dict(count.by_name),
                                                          "kernel_list": count.kernel_list,
                                                          "mb_by_name": {k: round(v / 1e6, 1) for k, v in
                                                                         count.bytes_by_name.items() if v >= 1e6}} for part, count in parts.items()}
            for name, parts in results.items()}


def print_table(results: dict, args) -> None:
    print(f"one linear {args.in_features} -> {args.out_features}, {args.tokens} tokens a micro-batch, bf16 autocast: "
          "kernels (of them small: <= 64 elements) and MB moved")
    print("| variant | forward, first micro-batch | forward, later ones | backward | end of step | "
          "MB a micro-batch / BF16's |")
    print("|---|---|---|---|---|---|")

    def mb(c: dict) -> float:
        return (c["bytes_read"] + c["bytes_written"]) / 1e6

    def per_micro_batch(parts: dict) -> float:
        return mb(parts["forward_later"]) + mb(parts["backward"])

    for name, parts in results.items():
        cells = [f"{parts[p]['kernels']} ({parts[p]['small']}), {mb(parts[p]):.1f} MB" for p in PARTS]
        print(f"| {name} | {' | '.join(cells)} | {per_micro_batch(parts) / per_micro_batch(results['bf16']):.2f} |")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--in_features", type=int, default=1536)
    p.add_argument("--out_features", type=int, default=6144)
    p.add_argument("--tokens", type=int, default=8192, help="tokens a micro-batch (exp8 on 8 GPUs: 8 x 1024)")
    p.add_argument("--gemm", nargs="+", default=[GEMM_EMULATED, GEMM_FP8], choices=[GEMM_EMULATED, GEMM_FP8])
    p.add_argument("--json", help="write the figures (and the kernels by name) to this file")
    p.add_argument("--by_name", action="store_true", help="also print every variant's kernels by name")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    results = measure(args)
    print_table(results, args)
    if args.by_name:
        for name, parts in results.items():
            for part in PARTS:
                print(f"{name} {part}: {parts[part]['by_name']}; MB: {parts[part]['mb_by_name']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
