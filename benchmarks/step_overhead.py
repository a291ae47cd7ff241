"""Training-step cost of HiF8 W8A8 QAT against the matched BF16 baseline, same process, same data.

Times optimizer steps of the exp8 QAT recipe *after the warmup* (max-window DTS, histories full,
weights and activations quantized, 8-bit saved inputs) against the unquantized model, alternating
the two step by step so machine drift hits both alike, and prints the median step-time ratio.
Peak memory: ``torch.cuda.max_memory_allocated`` on a GPU; on a CPU the peak RSS (VmHWM) of a fresh
child process per variant (a process's high-water mark cannot be reset, so each variant gets its
own), running the same steps, with glibc's mmap threshold pinned so that RSS follows the live
tensors (``--default-malloc`` adds the figure under glibc's defaults). Every round times each variant once,
back to back: the baseline, QAT at the defaults (what-if on every step), a logging step (health measured and
read out too) and QAT with the what-if off; the ratios are per round, to the baseline of the same round (median
and range), and the QAT step is also given at log intervals 1, 10 and 50 (every diagnostic on). Targets:
QAT / BF16 <= 1.05 at the default interval, health <= 3 % of the step it is measured in, memory ratio <= 1.0.

    python benchmarks/step_overhead.py                       # CPU, SmolLM2-135M, fp32
    python benchmarks/step_overhead.py --memory-only --bf16  # CPU, bf16 autocast (the GPU recipe)
    python benchmarks/step_overhead.py --openpangu --device cuda --seq-len 1024 --micro-batch 8
    python benchmarks/step_overhead.py --compare-gemm --no-memory   # QAT: emulated GEMM vs dequantize-first
    python benchmarks/step_overhead.py --profile [--profile-health]  # where a BF16 and a QAT step's time goes

``--gemm`` sets the QAT variant's product (``model.quant.gemm``: ``emulated``, the default, or
``dequantize_first``); ``--compare-gemm`` times the two QAT variants against each other instead (the
baseline is ``dequantize_first``), alternating step by step like the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from unittest import mock

import torch

from _common import int_options, seconds

from qat_app.config import QuantConfig, quantize_model
from qat_app.hif8.counters import HEALTH, gather_columns
from qat_app.hif8.health import summarize
from qat_app.hif8.quantized import set_health_measurement
from qat_app.hif8.scaling import AmaxScaler
from qat_app.hif8.step_record import COUNT_FIELDS, FIELDS, WHATIF_COUNT, named_scalers
from qat_app.hif8.training import end_warmup, start_warmup, sync_and_advance


def build_model(args) -> torch.nn.Module:
    if args.openpangu:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(hidden_size=1536, intermediate_size=6144, num_hidden_layers=26, num_attention_heads=12,
                             num_key_value_heads=12, vocab_size=args.vocab, max_position_embeddings=4096)
        torch.manual_seed(0)
        with torch.device(args.device):
            model = LlamaForCausalLM(config)
    else:
        from qat_app.models import load_causal_lm

        model, _ = load_causal_lm(args.model)
        model.to(args.device)
    model.config.use_cache = False
    return model.train()


def make_batches(args, vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (args.micro_batch, args.seq_len), generator=gen).to(args.device)
            for _ in range(args.accumulate)]


class Variant:
    def __init__(self, model: torch.nn.Module, batches, args, quantized: bool, gemm: str | None = None) -> None:
        self.model, self.batches, self.args = model, batches, args
        self.quantized = quantized
        if quantized:
            quant = QuantConfig(amax_algo="max", history_len=64, high_precision_layers=args.high_precision_layers,
                                fused=args.fused, gemm=gemm or args.gemm)
            self.report = quantize_model(model, quant)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=args.device == "cuda")
        # One BF16 step for both (the same number of steps, optimizer state created); for QAT it is
        # the end of the warmup: observers record it, the windows are seeded, quantization goes on.
        if quantized:
            start_warmup(model)
        self.step()
        if quantized:
            end_warmup(model)

    def step(self, diagnostics: str = "qat") -> None:
        """One optimizer step; ``diagnostics`` (QAT): "qat" (what-if on: every step), "qat+health" (a logging step:
        health measured too, and the saturation callback's read-out of the counters), "qat-whatif" (what-if off)."""
        autocast = torch.autocast(self.args.device, dtype=torch.bfloat16, enabled=self.args.bf16)
        with diagnostics_as(self.model, diagnostics):
            for ids in self.batches:
                with autocast:
                    loss = self.model(input_ids=ids, labels=ids).loss / len(self.batches)
                loss.backward()
            if self.quantized:
                sync_and_advance(self.model)  # the recipe's per-step protocol, as QATModule runs it
                read_counters(self.model, whatif=diagnostics != "qat-whatif", health=diagnostics == "qat+health")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def timed_step(self, diagnostics: str = "qat") -> float:
        cpu_start = time.process_time()
        wall = seconds(lambda: self.step(diagnostics), self.args.device)
        self.cpu_seconds = time.process_time() - cpu_start  # every thread of the process: what stolen cycles miss
        return wall


def variant_pair(args, first: tuple, second: tuple) -> tuple[Variant, Variant]:
    """Two variants of one model, the first on a copy of it (the same weights), on the same batches: each given as
    Variant's ``(quantized, gemm)``."""
    model = build_model(args)
    batches = make_batches(args, model.config.vocab_size)
    return Variant(copy.deepcopy(model), batches, args, *first), Variant(model, batches, args, *second)


# the variants of one round: the baseline, QAT at the defaults (what-if on every step), a logging step (health
# too), and QAT with the what-if off (its cost); a run's step costs ((N - 1) qat + qat+health) / N at log interval N
DIAGNOSTICS = ("bf16", "qat", "qat+health", "qat-whatif")
LOG_INTERVALS = (1, 10, 50)  # 50: Lightning's default log_every_n_steps


@contextlib.contextmanager
def diagnostics_as(model: torch.nn.Module, diagnostics: str):
    set_health_measurement(model, diagnostics == "qat+health")
    if diagnostics == "qat-whatif":  # no what-if: neither in the quantize pass nor a pass of its own
        with mock.patch.object(AmaxScaler, "_whatif_in_pass", lambda self, fmt: False), \
             mock.patch.object(AmaxScaler, "measure", lambda self, *args, **kwargs: (None, None)):
            yield
    else:
        yield
    set_health_measurement(model, False)


def read_counters(model: torch.nn.Module, whatif: bool, health: bool) -> None:
    """The saturation callback's per-step read-out (one device->host copy): the counts, the what-if's with
    ``whatif``, and the health vectors (summarized) on a logging step (``health``)."""
    counts = COUNT_FIELDS + ((WHATIF_COUNT,) if whatif else ()) + ((HEALTH,) if health else ())
    columns = gather_columns(named_scalers(model), FIELDS, counts)
    if health:
        summarize(columns[HEALTH], columns["last_amax"])


def report_step_ratios(times: dict[str, list[float]]) -> None:
    """Per variant: its steps, median, and the ratio to the baseline step of the same round (median and range over
    the rounds); the step cost at each log interval."""
    rounds = range(len(times["bf16"]))
    ratios = {d: sorted(times[d][r] / times["bf16"][r] for r in rounds) for d in DIAGNOSTICS}
    median = {d: statistics.median(ratios[d]) for d in DIAGNOSTICS}
    for d in DIAGNOSTICS:
        print(f"{d:>11}: steps {' '.join(f'{t:.2f}' for t in times[d])} s  median {statistics.median(times[d]):.3f} s  "
              f"ratio to bf16 {median[d]:.3f} (rounds {ratios[d][0]:.3f}..{ratios[d][-1]:.3f})")
    print(f"what-if costs {median['qat'] - median['qat-whatif']:+.3f} of a bf16 step; health costs "
          f"{median['qat+health'] / median['qat'] - 1:+.3f} of the QAT step it is measured in")
    for every in LOG_INTERVALS:
        step = ((every - 1) * median["qat"] + median["qat+health"]) / every
        print(f"log_every_n_steps={every:>2}: QAT step / bf16 step {step:.3f} (every diagnostic on)")


# glibc's default malloc raises its mmap threshold every time a large block is freed, after which
# freed tensors stay in the heap: the peak RSS then records the allocator's history (it moved by
# +-4% between identical runs here) more than the live tensors. Pinning the threshold makes every
# tensor above 64 KiB its own mapping, returned to the OS when freed, so RSS follows live memory.
PINNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def peak_rss_child(args, variant: str, malloc_env: dict[str, str]) -> int:
    """Run `--child VARIANT` in a fresh interpreter and return its peak RSS in bytes."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant] + [
        a for a in sys.argv[1:] if a not in ("--child", "--memory-only")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | malloc_env
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_rss"]


def report_peak_rss(args) -> None:
    settings = [("pinned mmap threshold", PINNED_MALLOC)]
    if args.default_malloc:
        settings.append(("default glibc malloc", {}))
    for label, env in settings:
        peaks = {name: peak_rss_child(args, name, env) for name in ("bf16", "qat")}
        print(f"peak RSS ({label}): baseline {peaks['bf16'] / 2**30:.3f} GiB  QAT {peaks['qat'] / 2**30:.3f} GiB  "
              f"ratio {peaks['qat'] / peaks['bf16']:.3f}")


def child(args) -> None:
    if args.fused != "off":
        # Load the compiler runtime in both children, so its code (~100-200 MB of RSS, a fixed cost of
        # the process, not of training) is not counted as QAT memory.
        from qat_app.hif8.fake_quant import fake_quantize

        fake_quantize(torch.ones(64), torch.tensor(1.0), 15.0, fused=args.fused)
    model = build_model(args)
    batches = make_batches(args, model.config.vocab_size)
    v = Variant(model, batches, args, quantized=args.child == "qat")
    for _ in range(args.mem_steps):
        v.step()
    with open("/proc/self/status") as f:
        hwm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
    print(json.dumps({"peak_rss": hwm_kb * 1024}))


def profile_steps(args) -> None:
    """The step profile's digest (qat_app.step_profile) of one BF16 and one QAT step (a logging step with
    ``--profile-health``), same data: where each one's time goes, by category, on the CPU or CUDA."""
    from torch.profiler import ProfilerActivity, profile

    from qat_app.step_profile import StepProfile, categorize

    variants = dict(zip(("bf16", "qat"), variant_pair(args, (False,), (True,))))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    diagnostics = "qat+health" if args.profile_health else "qat"
    for name, v in variants.items():
        kind = "bf16" if name == "bf16" else diagnostics
        v.timed_step(kind)  # warm-up: compilation
        with profile(activities=activities) as prof:
            wall = v.timed_step(kind)
        cpu, device = categorize(prof.events())
        result = StepProfile(1, 0, args.device, wall, cpu, device if args.device == "cuda" else {})
        print(f"--- {kind} step ---\n{result.table()}")


def compare_gemm(args) -> None:
    """QAT with the emulated GEMM against QAT dequantizing first: median step-time ratio, same process."""
    variants = dict(zip(("dequantize_first", "emulated"),
                        variant_pair(args, (True, "dequantize_first"), (True, "emulated"))))
    print(f"device={args.device} model={'openpangu-shaped' if args.openpangu else args.model} "
          f"tokens/step={args.micro_batch}x{args.seq_len}x{args.accumulate} bf16={args.bf16} fused={args.fused}")
    for v in variants.values():
        v.timed_step()  # warm-up: compilation, allocator
    times = {name: [] for name in variants}
    for _ in range(args.steps):
        for name, v in variants.items():
            times[name].append(v.timed_step())
    medians = {name: statistics.median(t) for name, t in times.items()}
    for name, t in times.items():
        print(f"step times (s), {name}: {' '.join(f'{x:.2f}' for x in t)}")
    print(f"step time (median): dequantize_first {medians['dequantize_first']:.3f}s  emulated {medians['emulated']:.3f}s"
          f"  ratio {medians['emulated'] / medians['dequantize_first']:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="embedded:smollm2-135m-instruct")
    p.add_argument("--openpangu", action="store_true", help="random OpenPangu-Embedded-1B-shaped Llama")
    p.add_argument("--vocab", type=int, default=153376)
    p.add_argument("--device", default="cpu")
    int_options(p, seq_len=256, micro_batch=4, accumulate=2)
    p.add_argument("--steps", type=int, default=4, help="timed steps per variant")
    int_options(p, mem_steps=2, high_precision_layers=5)
    p.add_argument("--fused", default="auto")
    p.add_argument("--gemm", default="emulated", help="model.quant.gemm of the QAT variant")
    p.add_argument("--compare-gemm", action="store_true",
                   help="time QAT with gemm=emulated against QAT with gemm=dequantize_first (the baseline)")
    p.add_argument("--profile", action="store_true",
                   help="print the step profile's digest of one BF16 and one QAT step instead of timing")
    p.add_argument("--profile-health", action="store_true", help="with --profile: the QAT step is a logging step")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (default on cuda)")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--memory-only", action="store_true")
    p.add_argument("--default-malloc", action="store_true",
                   help="also measure peak RSS under glibc's default malloc settings (history-dependent)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.bf16 = args.bf16 or args.device == "cuda"
    torch.set_num_threads(os.cpu_count() if args.device == "cuda" else torch.get_num_threads())
    if args.child:
        return child(args)

    if args.memory_only:
        return report_peak_rss(args)
    if args.compare_gemm:
        return compare_gemm(args)
    if args.profile:
        return profile_steps(args)
    base, qat = variant_pair(args, (False,), (True,))
    print(f"device={args.device} model={'openpangu-shaped' if args.openpangu else args.model} "
          f"tokens/step={args.micro_batch}x{args.seq_len}x{args.accumulate} bf16={args.bf16} fused={args.fused}")
    print(qat.report.summary())
    for diagnostics in DIAGNOSTICS:  # warm-up: compilation (every variant's kernels), allocator
        (base if diagnostics == "bf16" else qat).timed_step(diagnostics)
    times = {d: [] for d in DIAGNOSTICS}
    cpu_times = {d: [] for d in DIAGNOSTICS}
    for _ in range(args.steps):  # one round: every variant once, back to back, so drift hits all alike
        for diagnostics in DIAGNOSTICS:
            variant = base if diagnostics == "bf16" else qat
            times[diagnostics].append(variant.timed_step(diagnostics))
            cpu_times[diagnostics].append(variant.cpu_seconds)
    print("wall-clock time:")
    report_step_ratios(times)
    if args.device == "cpu":  # on a shared machine, steal time moves the wall clock; the CPU time less so
        print("process CPU time (both cores):")
        report_step_ratios(cpu_times)
    batches, qat, base = qat.batches, None, None  # the models freed
    if args.device == "cuda":
        peaks = {}
        for name in ("bf16", "qat"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            model = build_model(args)
            v = Variant(model, batches, args, quantized=name == "qat")
            torch.cuda.reset_peak_memory_stats()
            for _ in range(args.mem_steps):
                v.step()
            peaks[name] = torch.cuda.max_memory_allocated()
            del v, model
        print(f"peak memory (max_memory_allocated): baseline {peaks['bf16'] / 2**30:.2f} GiB  "
              f"QAT {peaks['qat'] / 2**30:.2f} GiB  ratio {peaks['qat'] / peaks['bf16']:.3f}")
    elif not args.no_memory:
        report_peak_rss(args)


if __name__ == "__main__":
    main()
