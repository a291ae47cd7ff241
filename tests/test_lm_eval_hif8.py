"""The recipe of docs/serving.md for scoring the real W8A8 model with lm-eval: its HFLM on the reloaded 8-bit export.

lm-eval's own log-likelihood of a continuation, on the model ``load_hif8`` rebuilt, must equal the
log-likelihood of the QAT model that was exported (same HiF8 codes and scales, so the same logits).
"""

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from qat_app.config import QuantConfig
from qat_app.export import export_hif8, load_hif8
from qat_app.config import quantize_model
from qat_app.hif8.scaling import all_scalers

import lm_eval.models.huggingface as lm_eval_hf
from lm_eval.api.instance import Instance


def continuation_loglik(model, tokenizer, context: str, continuation: str) -> float:
    ctx, cont = tokenizer(context).input_ids, tokenizer(continuation).input_ids
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logprobs = model(input_ids=ids).logits[0, len(ctx) - 1:-1].float().log_softmax(-1)
    return float(logprobs.gather(1, torch.tensor(cont)[:, None]).sum())


def test_lm_eval_scores_the_reloaded_hif8_model_like_the_qat_model(tmp_path, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    quantize_model(model, QuantConfig(high_precision_layers=1, fused="off", history_len=4))
    model.train()
    for seed in range(2):  # histories, so the export has delayed scales
        with torch.no_grad():
            model(input_ids=torch.randint(0, len(tokenizer), (2, 16), generator=torch.Generator().manual_seed(seed)))
        for scaler in all_scalers(model):
            scaler.advance()
    model.eval()
    export_hif8(model, tmp_path / "hif8", tokenizer=tokenizer, dtype="float32")

    reloaded = load_hif8(tmp_path / "hif8")
    lm = lm_eval_hf.HFLM(pretrained=reloaded, tokenizer=AutoTokenizer.from_pretrained(tmp_path / "hif8"), batch_size=2)
    requests = [("The model learns", " scale history"), ("Question: what is max?", " the window")]
    instances = [Instance("loglikelihood", {}, (c, x), idx) for idx, (c, x) in enumerate(requests)]
    scored = lm.loglikelihood(instances)
    for (context, continuation), (loglik, _) in zip(requests, scored):
        assert loglik == pytest.approx(continuation_loglik(model, tokenizer, context, continuation), abs=1e-4)
