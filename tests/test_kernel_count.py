"""The kernel and byte counter (qat_app.hif8.kernel_count) and the per-linear costs it measures
(benchmarks/linear_cost.py): counted against figures worked out by hand, and the GEMM's epilogue, the weight's E4M3
form and the FP8 operands checked as the work they save."""

from __future__ import annotations

import torch

from benchmarks import linear_cost
from qat_app.hif8.kernel_count import KernelCounter, counted_call


def test_a_matmul_is_one_kernel_with_the_bytes_of_its_operands_and_result():
    a, b = torch.randn(8, 4), torch.randn(4, 3)
    with KernelCounter() as counter:
        a.t(), a.view(-1), a.unsqueeze(0)  # views: no kernel
        torch.empty(10)  # an allocation: no kernel
        a @ b
    c = counter.count
    assert (c.kernels, c.small) == (1, 1)  # 24 output elements: small
    assert (c.bytes_read, c.bytes_written) == ((32 + 12) * 4, 24 * 4)


def test_an_input_passed_twice_is_read_once_and_small_kernels_are_told_apart():
    x = torch.randn(100, 100)
    with KernelCounter() as counter:
        x * x
        x.abs().amax()
    c = counter.count
    assert c.kernels == 3 and c.small == 1  # the amax's 0-d result is bookkeeping-sized
    assert c.bytes_read == 3 * 40_000 and c.bytes_written == 2 * 40_000 + 4
    assert dict(c.by_name) == {"mul": 1, "abs": 1, "amax": 1}


def test_a_fused_function_counts_as_one_kernel_reading_its_inputs_and_writing_its_outputs():
    x = torch.randn(1000)

    def three_ops(t):
        return (t * 2 + 1).abs()

    with KernelCounter() as counter:
        out = counted_call("fused", three_ops, x)
    assert torch.equal(out, three_ops(x))
    assert counter.count.kernels == 1 and dict(counter.count.by_name) == {"fused": 1}
    assert counter.count.bytes == 8000
    assert counted_call("fused", three_ops, x).shape == x.shape  # no counter: just the call


def test_the_per_linear_costs_show_the_epilogue_and_the_e4m3_weight_made_once_per_step():
    tokens, k, n = 32, 64, 96
    args = linear_cost.build_parser().parse_args(["--in_features", str(k), "--out_features", str(n),
                                                  "--tokens", str(tokens)])
    results = linear_cost.measure(args)
    bf16, emulated, fp8 = results["bf16"], results["emulated"], results["fp8"]
    for variant in (emulated, fp8):
        # the weight (and, on fp8, its E4M3 form) is made on the step's first micro-batch only
        assert variant["forward_later"]["kernels"] < variant["forward"]["kernels"]
        assert variant["forward_later"]["bytes_read"] < variant["forward"]["bytes_read"]
    later = emulated["forward_later"]["kernel_list"]
    # the GEMM reads the bf16 grid values of x and W and writes its fp32 accumulator; the epilogue reads that (and
    # the 0-d factor) and writes the bf16 output, once: no pass in fp32 for the factor, none of its own for the cast
    writing_output = [kernel for kernel in later if kernel[2] in (tokens * n * 2, tokens * n * 4)]
    assert writing_output == [("mm", (tokens * k + n * k) * 2, tokens * n * 4), ("mul", tokens * n * 4 + 4, tokens * n * 2)]
    # fp8's later forward converts no weight (its E4M3 form was made once this step); the input's E4M3 form comes
    # from its 8-bit codes: a byte read and a byte written per element
    table = 256
    assert [kernel for kernel in fp8["forward_later"]["kernel_list"] if kernel[0] == "e4m3_from_codes"] == [
        ("e4m3_from_codes", tokens * k + table, tokens * k)]
    assert [kernel for kernel in fp8["forward"]["kernel_list"] if kernel[0] == "e4m3_from_codes"] == [
        ("e4m3_from_codes", n * k + table, n * k), ("e4m3_from_codes", tokens * k + table, tokens * k)]
    # backward: two GEMMs as in BF16, each with one epilogue, and the saved input's one decode
    assert emulated["backward"]["by_name"]["mm"] == bf16["backward"]["by_name"]["mm"] == 2
    assert emulated["backward"]["by_name"]["dequantize_codes"] == 1
    assert emulated["backward"]["by_name"]["mul"] == 2
