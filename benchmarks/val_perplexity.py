"""Held-out perplexity of finished runs against a baseline run, paired per sequence, with 95% intervals.

    python benchmarks/val_perplexity.py --config configs/cpu_study.yaml \
        --baseline runs/qad_cpu/qat_lr1e-5/checkpoints/last.ckpt \
        --runs runs/qad_cpu/qad_lr1e-5/checkpoints/last.ckpt [--initial] [--batches 64]

Each run's QATModule is restored from its checkpoint (quantized as it trained); ``--initial`` adds the model the
runs started from, unquantized. Every model scores the same held-out sequences of the config's data
(``data.val_documents``); the ratio of two perplexities is ``exp`` of their paired mean NLL difference, a sequence
one unit (:func:`qat_app.stats.paired_difference`), so the interval is the sequences' and not the tokens'.
Other LightningCLI flags (``--data.init_args...``) pass through to the data.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from qat_app import stats  # noqa: E402
from qat_app.config import QuantConfig  # noqa: E402
from qat_app.export.cli import _datamodule  # noqa: E402
from qat_app.export.qat_checkpoint import load_qat_checkpoint  # noqa: E402
from qat_app.inspection import text_batches  # noqa: E402


def initial_model(module):
    """The model ``module``'s run started from, unquantized."""
    from qat_app.module import QATModule

    hparams = dict(module.hparams)
    initial = QATModule(model_name=hparams["model_name"], gguf_file=hparams.get("gguf_file"),
                        dtype=hparams.get("dtype", "float32"), quant=QuantConfig(enabled=False))
    return initial.eval()


@torch.no_grad()
def sequence_nll(module, batches) -> torch.Tensor:
    """Each held-out sequence's mean next-token NLL under ``module``'s model (as it runs: quantized where it is)."""
    out = []
    for ids in batches:
        logits = module.model(input_ids=ids).logits.float()[:, :-1]
        out.append(-logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1).mean(1))
    return torch.cat(out).double()


def ratio_line(name: str, nll: torch.Tensor, reference: torch.Tensor) -> str:
    """``name``'s perplexity / the reference's, paired per sequence (a sequence one unit), with its 95% interval."""
    result = stats.paired_difference(reference.numpy(), nll.numpy())
    return (f"| {name} | {math.exp(result.after):.3f} | {math.exp(result.difference):.4f} "
            f"[{math.exp(result.low):.4f}, {math.exp(result.high):.4f}] |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="the baseline run's checkpoint")
    parser.add_argument("--runs", nargs="+", required=True, help="the compared runs' checkpoints")
    parser.add_argument("--initial", action="store_true", help="also the unquantized model the runs started from")
    parser.add_argument("--batches", type=int, default=64, help="held-out batches (default 64: all of a small set)")
    args, lightning_args = parser.parse_known_args(argv)
    batches, what = text_batches(_datamodule(lightning_args), "auto", args.batches)
    baseline = load_qat_checkpoint(args.baseline)
    nll = {args.baseline: sequence_nll(baseline, batches)}
    nll.update({path: sequence_nll(load_qat_checkpoint(path), batches) for path in args.runs})
    if args.initial:
        nll["initial (unquantized)"] = sequence_nll(initial_model(baseline), batches)
    print(f"{what}: {sum(len(b) for b in batches)} sequences, {sum(b[:, 1:].numel() for b in batches)} predicted tokens")
    for reference in [args.baseline] + (["initial (unquantized)"] if args.initial else []):
        print(f"\n| model | perplexity | / {reference} [95% CI] |\n|---|---:|---|")
        print("\n".join(ratio_line(name, values, nll[reference]) for name, values in nll.items() if name != reference))


if __name__ == "__main__":
    main()
