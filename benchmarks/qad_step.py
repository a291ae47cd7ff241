"""What distillation costs: peak memory and time of a QAD training step against a QAT step, at a large vocabulary.

    python benchmarks/qad_step.py                      # the paper's vocabulary (153,376), a small Llama body
    python benchmarks/qad_step.py --vocab 49152 --seq 1024

Both steps train the same HiF8-quantized Llama (forward, loss, backward) on the same batch: the QAT step as the
trainer runs it without distillation (transformers' causal-LM loss over the whole logits), the QAD step as it
runs with ``model.distill.enabled`` (:meth:`qat_app.distill.Teacher.loss`: the teacher's forward, KL and CE a
chunk at a time). Each runs ``--repeats`` times in a fresh process of its own, so that its peak is its own: on a
GPU ``torch.cuda.max_memory_allocated``, on a CPU the process's peak resident memory (``ru_maxrss``), each minus
what the process held before the first step. Printed: both, their ratios, and the size of one model's whole
logits in float32, which the QAD step must stay under. Ratios are from one run of each.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import int_options, seconds  # noqa: E402


def _model(args, device):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64), num_key_value_heads=max(1, args.hidden // 64),
        max_position_embeddings=args.seq, tie_word_embeddings=False)).to(device)


def _peak(device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux


def worker(args) -> dict:
    """One kind of step, ``--repeats`` times, in this process -> its peak and mean time."""
    import torch

    from qat_app.config import QuantConfig, quantize_model
    from qat_app.distill import DistillConfig, Teacher

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = _model(args, device)
    teacher = Teacher.initial(model) if args.kind == "qad" else None
    quantize_model(model, QuantConfig(high_precision_layers=0, fused="off"))
    model.train()
    config = DistillConfig(enabled=True, kl_weight=1.0, ce_weight=0.0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)).to(device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    before = _peak(device)

    def step() -> None:
        loss = model(input_ids=ids, labels=ids).loss if teacher is None else teacher.loss(model, ids, ids, config)[0]
        loss.backward()
        model.zero_grad(set_to_none=True)

    times = [seconds(step, device) for _ in range(args.repeats)]
    held = sum(p.numel() * p.element_size() for p in teacher.model.parameters()) / 2**20 if teacher else 0.0
    return {"kind": args.kind, "device": str(device), "peak_mib": _peak(device) - before, "teacher_mib": held,
            "seconds": sum(times[1:]) / max(1, len(times) - 1) if len(times) > 1 else times[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    int_options(parser, vocab=153_376, hidden=256, layers=2, seq=512, batch=2, repeats=3)
    parser.add_argument("--kind", choices=("qat", "qad"), help=argparse.SUPPRESS)  # the worker's
    args = parser.parse_args(argv)
    if args.kind:
        print(json.dumps(worker(args)))
        return 0
    flags = [f"--{k}={getattr(args, k)}" for k in ("vocab", "hidden", "layers", "seq", "batch", "repeats")]
    rows = {}
    for kind in ("qat", "qad"):
        done = subprocess.run([sys.executable, __file__, *flags, f"--kind={kind}"], capture_output=True, text=True)
        if done.returncode != 0:
            print(f"error: the {kind} step failed: {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            return 2
        rows[kind] = json.loads(done.stdout.strip().splitlines()[-1])
    logits_mib = args.batch * args.seq * args.vocab * 4 / 2**20
    qat, qad = rows["qat"], rows["qad"]
    print(f"{args.batch} x {args.seq} tokens, vocabulary {args.vocab:,}, Llama {args.layers} x {args.hidden} "
          f"({qat['device']}); one model's whole logits in float32: {logits_mib:.0f} MiB")
    print("| step | peak memory over the start, MiB | seconds per step |\n|---|---:|---:|")
    for row in (qat, qad):
        print(f"| {row['kind'].upper()} | {row['peak_mib']:.0f} | {row['seconds']:.3f} |")
    print(f"QAD / QAT: memory {qad['peak_mib'] / max(qat['peak_mib'], 1e-9):.2f}x, time "
          f"{qad['seconds'] / qat['seconds']:.2f}x; the teacher's weights besides: {qad['teacher_mib']:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
