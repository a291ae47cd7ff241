"""The paper's recipe (exp8) in a plain PyTorch loop, without Lightning or this app: HiF8 W8A8 QAT of a
Hugging Face causal LM with the max-window delayed scaling, a BF16 warmup, then QAT at lr 1e-5.

    python examples/plain_pytorch_loop.py --model HuggingFaceTB/SmolLM2-135M --steps 200 --warmup 50

Without --model it trains a tiny random Llama on random tokens (a smoke run, seconds on a CPU).
With --fallback, a tensor that keeps saturating (events in 8 of its last 16 quantized steps) switches to
current scaling for the rest of the run (qat_app.hif8.fallback; keep the monitor's state_dict with your
checkpoint to resume it exactly).

Under DistributedDataParallel, call ``keep_scalers_out_of_ddp_broadcast(model)`` before wrapping the model:
DDP's buffer broadcast would otherwise overwrite each rank's saturation counters with rank 0's
(``sync_and_advance`` keeps the scales themselves equal on every rank).
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from qat_app.hif8 import (FallbackMonitor, FallbackPolicy, HiF8Recipe, LayerSelection, convert_to_hif8_training,
                          end_warmup, start_warmup, sync_and_advance)


def run(model_name=None, steps=12, warmup=4, lr=1e-5, batch=2, seq_len=32, history_len=64, high_precision_layers=5,
        fallback: FallbackPolicy | None = None):
    if model_name:
        model = AutoModelForCausalLM.from_pretrained(model_name, dtype=torch.float32)
    else:
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                             num_attention_heads=4, num_key_value_heads=4, vocab_size=256))
    report = convert_to_hif8_training(model, HiF8Recipe(amax_algo="max", history_len=history_len),
                                      LayerSelection(high_precision_layers=high_precision_layers))
    print(report.summary())
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    monitor = FallbackMonitor.for_model(fallback, model) if fallback is not None else None
    vocab = model.config.vocab_size
    model.train()
    start_warmup(model)  # BF16 warmup: the observers fill the amax histories, nothing is quantized
    losses = []
    for step in range(steps):
        if step == warmup:
            end_warmup(model)  # seed the windows, switch W8A8 on
        ids = torch.randint(0, vocab, (batch, seq_len))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        record = sync_and_advance(model, nonfinite=~torch.isfinite(loss), step=step, fallback=monitor)  # once a step
        for decision in record.fallback:  # the policy decided on this step's counters, after the scalers advanced
            print(f"fallback: {decision['module']}.{decision['operand']} -> {decision['target']} "
                  f"({decision['reason']}: {decision['evidence']})")
        if record.skipped:
            optimizer.zero_grad(set_to_none=True)  # a NaN/inf step is skipped, its amax discarded
            continue
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
        print(f"step {step} {'QAT' if step >= warmup else 'warmup'} loss {losses[-1]:.4f}")
    return model, losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--fallback", action="store_true", help="apply the default fallback policy")
    args = parser.parse_args()
    run(args.model, args.steps, args.warmup, args.lr, fallback=FallbackPolicy() if args.fallback else None)
