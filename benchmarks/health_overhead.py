"""Step-time cost of the numeric-health and what-if measurements (qat_app.hif8.health), same process, same data.

At the quickstart shape (configs/quickstart.yaml: the embedded SmolLM2-135M, fp32, 4 x 128 tokens x 2
micro-batches, max window 8, 5 boundary blocks in high precision, ``fused=auto``) it times, after the warmup
switch, optimizer steps of one converted model in three variants, alternated step by step so machine drift
hits all alike:

    baseline   what-if and health switched off (``AmaxScaler.measure`` stubbed out): the QAT step before them
    what-if    every quantized step counts what the other estimators would clip (what every step pays)
    health     a logging step: what-if plus the health measurement and its read-out (the callback's gather)

Each step also reads the scalers once, as the saturation callback does (with the what-if counts, and the health
vectors on a health step). Health runs only every ``log_every_n_steps``, so the cost of a run is
``((N - 1) * what-if + health) / N``, from each variant's median ratio to the baseline step of the same round,
for N = 1, 10 (the paper's configs) and 50 (Lightning's default). Also the same from the
time spent inside the measurements (``AmaxScaler.measure`` and the extra read-out) over the rest of the same
step: less sensitive to other jobs on the machine (on a CPU that time is the cost; on a GPU, where the
measurements run asynchronously, the step ratios are the figure). Target: <= 1.03 at the default interval.

    python benchmarks/health_overhead.py
    python benchmarks/health_overhead.py --device cuda --steps 10
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from _common import int_options, seconds
from step_overhead import LOG_INTERVALS, build_model, make_batches, read_counters

from qat_app.config import QuantConfig, quantize_model
from qat_app.hif8.quantized import set_health_measurement
from qat_app.hif8.scaling import AmaxScaler
from qat_app.hif8.training import end_warmup, start_warmup, sync_and_advance

VARIANTS = ("baseline", "what-if", "health")
MEASURE = AmaxScaler.measure
WHATIF_IN_PASS = AmaxScaler._whatif_in_pass
inside = [0.0]  # seconds spent in AmaxScaler.measure (what-if and health) during the current step


def no_measurement(self, *args, **kwargs):
    return None, None


def timed_measurement(self, *args, **kwargs):
    start = time.perf_counter()
    try:
        return MEASURE(self, *args, **kwargs)
    finally:
        inside[0] += time.perf_counter() - start


class Run:
    def __init__(self, args) -> None:
        self.args = args
        self.model = build_model(args)  # on the device, in training mode, without the KV cache
        quant = QuantConfig(amax_algo="max", history_len=8, high_precision_layers=5, fused=args.fused)
        self.report = quantize_model(self.model, quant)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.batches = make_batches(args, self.model.config.vocab_size)
        start_warmup(self.model)  # one observed step, then quantization on (histories seeded), as the recipe does
        self.step("baseline")
        end_warmup(self.model)

    def step(self, variant: str) -> None:
        AmaxScaler.measure = no_measurement if variant == "baseline" else timed_measurement
        # the what-if counted inside the quantize pass too (where the rule allows): none in the baseline
        AmaxScaler._whatif_in_pass = (lambda self, fmt: False) if variant == "baseline" else WHATIF_IN_PASS
        set_health_measurement(self.model, variant == "health")
        inside[0] = 0.0
        for ids in self.batches:
            (self.model(input_ids=ids, labels=ids).loss / len(self.batches)).backward()
        sync_and_advance(self.model)
        start = time.perf_counter()
        read_counters(self.model, whatif=variant != "baseline", health=variant == "health")  # the callback's read-out
        self.readout = time.perf_counter() - start
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        set_health_measurement(self.model, False)

    def timed_step(self, variant: str) -> tuple[float, float, float]:
        """-> (step time, of which in AmaxScaler.measure, of which in the read-out)."""
        return seconds(lambda: self.step(variant), self.args.device), inside[0], self.readout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="embedded:smollm2-135m-instruct")
    p.add_argument("--device", default="cpu")
    int_options(p, seq_len=128, micro_batch=4, accumulate=2)
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant")
    p.add_argument("--fused", default="auto")
    p.set_defaults(openpangu=False)  # build_model: the --model itself
    args = p.parse_args()
    run = Run(args)
    print(f"device={args.device} model={args.model} tokens/step={args.micro_batch}x{args.seq_len}x{args.accumulate} "
          f"fused={args.fused}")
    print(run.report.summary())
    warm = {variant: run.timed_step(variant)[0] for variant in VARIANTS}  # compilation, allocator
    print("warm-up steps: " + "  ".join(f"{v} {t:.1f} s" for v, t in warm.items()), flush=True)
    times = {v: [] for v in VARIANTS}
    direct = {v: [] for v in VARIANTS}  # the measurement's own share: its time over the rest of the same step
    for round_ in range(args.steps):
        measured = {variant: run.timed_step(variant) for variant in VARIANTS}
        for variant, (step, in_measure, readout) in measured.items():
            times[variant].append(step)
            extra = in_measure + readout - measured["baseline"][2]
            direct[variant].append(extra / (step - extra))
        print(f"round {round_ + 1}: " + "  ".join(f"{v} {t[-1]:.3f} s (measure {measured[v][1]:.3f} s)"
                                                for v, t in times.items()), flush=True)
    # each round's steps ran back to back: their ratios cancel drift between rounds (other jobs on the machine)
    ratio = {v: statistics.median(t / b for t, b in zip(times[v], times["baseline"])) for v in VARIANTS}
    for variant in VARIANTS:
        print(f"{variant:>9}: steps {' '.join(f'{t:.3f}' for t in times[variant])} s  "
              f"median {statistics.median(times[variant]):.3f} s  ratio to baseline (median of rounds) {ratio[variant]:.4f}")
    own = {v: 1.0 + statistics.median(direct[v]) for v in VARIANTS}
    print("time inside the measurements and the extra read-out, over the rest of the step (median of rounds): "
          + "  ".join(f"{v} {own[v] - 1:+.4f}" for v in VARIANTS[1:]))
    for every in LOG_INTERVALS:
        amortised = ((every - 1) * ratio["what-if"] + ratio["health"]) / every
        amortised_own = ((every - 1) * own["what-if"] + own["health"]) / every
        print(f"log_every_n_steps={every:>2}: step time ratio {amortised:.4f} (health + what-if vs none); "
              f"from the time inside them {amortised_own:.4f}")


if __name__ == "__main__":
    main()
