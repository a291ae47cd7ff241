"""Tiny models and tokenizers shared by several test files: random Llama checkpoints saved with the embedded
SmolLM2 tokenizer (loadable by path like a hub model), random MoE models, a small trained byte-level BPE."""

from __future__ import annotations

import torch


def save_tiny_llama(path, tokenizer, *, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                    max_position_embeddings=256, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(
        hidden_size=hidden_size, intermediate_size=intermediate_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=2, num_key_value_heads=2, vocab_size=len(tokenizer),
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def random_llama(vocab_size: int, attention: str = "sdpa", seed: int = 0):
    """A 2-block random Llama (hidden 32) in eval mode, for scoring tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )
    config._attn_implementation = attention
    return LlamaForCausalLM(config).eval()


def moe_model(model_type: str, *, hidden_size: int = 32, intermediate_size: int = 48, experts: int = 4,
              vocab_size: int = 64):
    """A 4-block random MoE model (``mixtral``, ``qwen2_moe`` or ``qwen3_moe``), 2 experts per token, eager experts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    H, I, E = hidden_size, intermediate_size, experts
    common = dict(hidden_size=H, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
                  vocab_size=vocab_size)
    extra = {"mixtral": dict(intermediate_size=I, num_local_experts=E, num_experts_per_tok=2),
             "qwen2_moe": dict(intermediate_size=I, moe_intermediate_size=I, shared_expert_intermediate_size=I,
                               num_experts=E, num_experts_per_tok=2, decoder_sparse_step=1),
             "qwen3_moe": dict(intermediate_size=I, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=2,
                               decoder_sparse_step=1, head_dim=hidden_size // 2)}[model_type]
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **common, **extra))
    model.config._experts_implementation = "eager"
    return model


def byte_level_tokenizer(vocab_size: int = 400):
    """A small trained byte-level BPE (every string encodes; no GGUF conversion needed)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    corpus = ["Question: Which of these is the answer?\nAnswer: the answer is B.", "The following are multiple choice questions"]
    tokenizer.train_from_iterator(corpus * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def tiny_qat(dtype=torch.bfloat16, steps=2, tie=True, amax_algo="max", seed=0, **quant_kwargs):
    """A 3-block random Llama, patched (boundary block 0 stays in high precision), scalers with a history."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from qat_app.config import QuantConfig, quantize_model
    from qat_app.hif8.scaling import all_scalers

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=96, max_position_embeddings=64, tie_word_embeddings=tie,
    )
    model = LlamaForCausalLM(config).to(dtype)
    # make activations and weights clip a bit, so codes include the saturated max
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "mlp" in name:
                p.mul_(3.0)
    quant = QuantConfig(high_precision_layers=1, fused="off", history_len=4, amax_algo=amax_algo, **quant_kwargs)
    quantize_model(model, quant)
    model.train()
    for _ in range(steps):
        with torch.no_grad():
            model(input_ids=torch.randint(0, 96, (2, 12)))
        for scaler in all_scalers(model):
            scaler.advance()
    model.eval()
    return model


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 96, (3, 16), generator=g)


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def save_qat_checkpoint(path, model_dir, precision: str = "32-true"):
    """A QATModule on ``model_dir`` (boundary block 0 in high precision) whose scalers have a 2-step history, saved
    by a Lightning Trainer of ``precision`` (attached, so the checkpoint records it) -> ``path``."""
    import lightning as L

    from qat_app.config import QuantConfig
    from qat_app.hif8.scaling import all_scalers
    from qat_app.module import QATModule

    module = QATModule(model_name=str(model_dir), quant=QuantConfig(high_precision_layers=1, fused="off", history_len=4))
    module.model.train()
    for _ in range(2):
        with torch.no_grad():
            module.model(input_ids=torch.randint(0, 200, (2, 12)))
        for s in all_scalers(module.model):
            s.advance()
    trainer = L.Trainer(precision=precision, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu")
    trainer.strategy.connect(module)
    module.trainer = trainer
    trainer.save_checkpoint(path)
    return path


def write_sharded(ckpt: dict, directory) -> None:
    """``ckpt`` as Lightning's ModelParallelStrategy saves it: ``state_dict`` through DCP (one process here),
    the rest in ``meta.pt``."""
    import os

    import torch.distributed.checkpoint as dcp

    from qat_app.sharded_checkpoint import LIGHTNING_META_FILE

    rest = {k: v for k, v in ckpt.items() if k not in ("state_dict", "optimizer_states")}
    dcp.save({"state_dict": ckpt["state_dict"]}, checkpoint_id=str(directory), no_dist=True)
    torch.save(rest, os.path.join(directory, LIGHTNING_META_FILE))
