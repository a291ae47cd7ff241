"""Cost of the per-optimizer-step scaler update: one scaler at a time vs the stacked, batched update.

For N scalers (126: the paper's openPangu layout, 63 linears x input + weight; 4096: an MoE model),
each with an observed step, it measures in the same process the ops (aten calls at the top level,
from torch.profiler) and the wall time of one step's update: ``AmaxScaler.advance`` for each scaler
(one bank of one scaler each: the same batched code, called N times) and
:func:`qat_app.hif8.scaler_bank.advance_all` (one batched update of all the stacked views). Prints both and
their ratio.

    python benchmarks/scaler_update.py                 # CPU
    python benchmarks/scaler_update.py --device cuda
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from _common import seconds

from qat_app.hif8.scaler_bank import advance_all
from qat_app.hif8.scaling import AmaxScaler


def scalers_with_a_step(n: int, device: str) -> list[AmaxScaler]:
    scalers = [AmaxScaler("max", history_len=64, device=device) for _ in range(n)]
    for s in scalers:
        s.observe(torch.tensor(1.5, device=device), torch.tensor(3, device=device), 1000)
    return scalers


def one_at_a_time(scalers) -> None:
    for s in scalers:
        s.advance()


def observe_again(scalers, device) -> None:
    amax = torch.tensor(2.0, device=device)
    for s in scalers:
        s.observe(amax, None, 0)


def measure(update, scalers, device: str, repeats: int) -> tuple[int, float]:
    update(scalers)  # warm (and, for the batched update, stack once)
    observe_again(scalers, device)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        update(scalers)
    ops = sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)
    times = []
    for _ in range(repeats):
        observe_again(scalers, device)
        times.append(seconds(lambda: update(scalers), device))
    return ops, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sizes", type=int, nargs="+", default=[126, 4096])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print(f"{'scalers':>8} {'update':>14} {'ops':>7} {'ms/step':>9} {'ratio':>7}")
    for n in args.sizes:
        base_ops, base_t = measure(one_at_a_time, scalers_with_a_step(n, args.device), args.device, args.repeats)
        ops, t = measure(advance_all, scalers_with_a_step(n, args.device), args.device, args.repeats)
        print(f"{n:>8} {'one at a time':>14} {base_ops:>7} {base_t * 1e3:>9.2f} {1.0:>7.2f}")
        print(f"{n:>8} {'batched':>14} {ops:>7} {t * 1e3:>9.2f} {t / base_t:>7.3f}")


if __name__ == "__main__":
    main()
