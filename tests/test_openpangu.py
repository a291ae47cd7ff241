"""openPangu-Embedded loaded natively (qat_app.openpangu): no remote code, same model as upstream's.

The reference is the UPSTREAM remote code (``../shared/fixtures/openpangu`` beside the checkout, see its
SOURCE.md): copied into tmp_path, patched there for the five transformers-5 incompatibilities SOURCE.md
lists, built with ``trust_remote_code=True`` and saved with random weights. The project's loader then
reads the same directory without remote code and must give the same tensors, logits and quantized layout.
"""

from __future__ import annotations

import copy
import io
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path

import pytest
import torch

from qat_app import openpangu
from qat_app.config import QuantConfig, quantize_model
from qat_app.hif8.linear import HiF8Linear
from qat_app.models import load_causal_lm, load_tokenizer
from tests._paper_layout import assert_paper_layout

# shared/ lies beside the checkout (as CI lays it out); OPENPANGU_FIXTURE overrides
FIXTURE = Path(os.environ.get(
    "OPENPANGU_FIXTURE", Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "openpangu"))
needs_fixture = pytest.mark.skipif(
    not (FIXTURE / "modeling_openpangu_dense.py").is_file(), reason=f"upstream openPangu files not found in {FIXTURE}"
)

AUTO_MAP = {
    "AutoConfig": "configuration_openpangu_dense.PanguEmbeddedConfig",
    "AutoModel": "modeling_openpangu_dense.PanguEmbeddedModel",
    "AutoModelForCausalLM": "modeling_openpangu_dense.PanguEmbeddedForCausalLM",
}
# The upstream tokenizer's specials (tokenizer_config.json of the 7B: eos "[unused10]", pad "<unk>").
SPECIALS = [(0, "<unk>"), (1, "<s>"), (2, "</s>"), (3, "[unused9]"), (4, "[unused10]")]
EOS_ID = 4


# ------------------------------------------------------------------------------------------ upstream copy
def _replace(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"upstream file changed, shim does not apply: {old!r}"
    return text.replace(old, new)


def patched_upstream_copy(dst: Path) -> None:
    """The fixture's remote code in ``dst``, with SOURCE.md's five transformers-5 shims applied to the copy."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(FIXTURE / "configuration_openpangu_dense.py", dst)
    src = (FIXTURE / "modeling_openpangu_dense.py").read_text()
    # 1. the unconditional torch_npu import and NPU device query at import time
    src, n = re.subn(
        r"import torch_npu\nfrom torch_npu\.contrib import transfer_to_npu\n"
        r"if \"910\" in torch\.npu\.get_device_name\(\):\n(?:    .*\n)+else:\n    NPU_ATTN_INFR = False\n",
        "NPU_ATTN_INFR = False\n", src,
    )
    assert n == 1 and "import torch_npu\n" not in src
    # 2. LossKwargs is gone in v5: TransformersKwargs replaces it
    src = _replace(src, "from transformers.utils import LossKwargs,",
                   "from transformers.utils import TransformersKwargs as LossKwargs,")
    # 3. no "default" entry in ROPE_INIT_FUNCTIONS: inv_freq = 1 / theta ** (arange(0, d, 2) / d), scaling 1.0
    src = _replace(src, "class PanguEmbeddedRotaryEmbedding(nn.Module):",
                   "def _default_rope(config, device=None):\n"
                   "    dim = getattr(config, 'head_dim', None) or config.hidden_size // config.num_attention_heads\n"
                   "    exps = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim\n"
                   "    return 1.0 / (config.rope_theta ** exps), 1.0\n\n\n"
                   "class PanguEmbeddedRotaryEmbedding(nn.Module):")
    src = _replace(src, "self.rope_init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]",
                   "self.rope_init_fn = _default_rope if self.rope_type == 'default' else ROPE_INIT_FUNCTIONS[self.rope_type]")
    # 4. _tied_weights_keys is a dict in v5
    src = _replace(src, '_tied_weights_keys = ["lm_head.weight"]',
                   '_tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}')
    # 5. create_causal_mask: inputs_embeds=, and the cache as cache=
    src = _replace(src,
                   "input_embeds=inputs_embeds,\n            attention_mask=attention_mask,\n"
                   "            cache_position=cache_position,\n            past_key_values=past_key_values,",
                   "inputs_embeds=inputs_embeds,\n            attention_mask=attention_mask,\n"
                   "            cache=past_key_values,")
    (dst / "modeling_openpangu_dense.py").write_text(src)


# ------------------------------------------------------------------------------------------ tokenizer
def _corpus() -> list[str]:
    rng = random.Random(0)
    words = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly vexed kings "
             "under pale moonlight near old stone bridges").split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 14))) for _ in range(400)]
    return lines + ["Numbers 0123456789, punctuation: this! (really?)", "Mixed CASE Text", "def f(x):\n    return x"] * 20


def train_sentencepiece(model_type: str = "bpe") -> bytes:
    """A tiny SentencePiece model shaped like openPangu's: <unk>/<s>/</s> = 0/1/2, user-defined [unusedN], byte
    fallback, SentencePiece's default nmt_nfkc normalizer (NFKC + folding of extra spaces)."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()), model_writer=buf, vocab_size=340, model_type=model_type,
        character_coverage=1.0, byte_fallback=True, user_defined_symbols=["[unused9]", "[unused10]"],
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
    )
    return buf.getvalue()


def write_upstream_tokenizer(directory: Path, sp_model: bytes) -> None:
    """tokenizer.model + the upstream repo's tokenizer_config.json / special_tokens_map.json (remote PanguTokenizer)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.model").write_bytes(sp_model)
    added = {str(i): {"content": c, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": True} for i, c in SPECIALS}
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": True, "add_eos_token": False, "add_prefix_space": True, "added_tokens_decoder": added,
        "auto_map": {"AutoTokenizer": ["tokenization_openpangu.PanguTokenizer", None]},
        "bos_token": "<s>", "clean_up_tokenization_spaces": False, "eos_token": "[unused10]", "legacy": True,
        "model_max_length": 1000000000000000019884624838656, "pad_token": "<unk>", "sp_model_kwargs": {},
        "spaces_between_special_tokens": False, "tokenizer_class": "PanguTokenizer", "unk_token": "<unk>",
        "use_default_system_prompt": False,
    }))
    (directory / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "[unused10]", "pad_token": "<unk>", "unk_token": "<unk>"}))


def upstream_encode(sp, text: str) -> list[int]:
    """What upstream's PanguTokenizer (a slow PreTrainedTokenizer) gives: <s>, then the text split on its added
    tokens, each other chunk encoded by ``SentencePieceProcessor.encode``."""
    ids = {c: i for i, c in SPECIALS}
    out = [ids["<s>"]]
    for chunk in re.split("(" + "|".join(re.escape(c) for _, c in SPECIALS) + ")", text):
        if chunk:
            out += [ids[chunk]] if chunk in ids else sp.encode(chunk)
    return out


@pytest.fixture(scope="module")
def sp_model() -> bytes:
    return train_sentencepiece("bpe")


# ------------------------------------------------------------------------------------------ tiny models
# attention_dropout: upstream's attention reads it though PanguEmbeddedConfig has no default (config.json has it)
BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            max_position_embeddings=256, initializer_range=0.2, attention_dropout=0.0)
TINY_CONFIGS = {
    # every field given, none at a default: bias, GQA, head_dim != hidden/heads, tied embeddings
    "explicit": dict(BASE, num_key_value_heads=2, head_dim=24, bias=True, rms_norm_eps=1e-4, rope_theta=500.0,
                     tie_word_embeddings=True, hidden_act="silu", pad_token_id=0,
                     bos_token_id=1, eos_token_id=EOS_ID, use_cache=True),
    # the fields a config.json may leave out take upstream's defaults (bias, eps 1e-5, theta 1.6e7), not Llama's
    "defaults": dict(BASE, num_key_value_heads=2),
    # no attention bias, plain multi-head attention
    "nobias": dict(BASE, num_key_value_heads=4, bias=False, rope_theta=10000.0, eos_token_id=EOS_ID),
}


def _inputs(vocab: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, vocab, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding in the second row
    return ids, mask


def _logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def make_upstream_checkpoint(directory: Path, fields: dict, sp_model: bytes, seed: int = 0):
    """A random openPangu-Embedded checkpoint written by the upstream class; returns the upstream model."""
    import sentencepiece as spm
    from transformers import AutoConfig, AutoModelForCausalLM

    patched_upstream_copy(directory)
    vocab = spm.SentencePieceProcessor(model_proto=sp_model).get_piece_size()
    config = {"architectures": ["PanguEmbeddedForCausalLM"], "auto_map": AUTO_MAP, "model_type": "PanguEmbedded",
              "vocab_size": vocab, "torch_dtype": "float32", **fields}
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    upstream_config = AutoConfig.from_pretrained(str(directory), trust_remote_code=True)
    assert type(upstream_config).__name__ == "PanguEmbeddedConfig"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(upstream_config, trust_remote_code=True, dtype=torch.float32)
    assert type(model).__name__ == "PanguEmbeddedForCausalLM"
    with torch.no_grad():  # upstream's init zeroes the biases: make them count
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.eval()
    model.save_pretrained(str(directory))
    write_upstream_tokenizer(directory, sp_model)
    # save_pretrained rewrote config.json from the upstream config: keep the hub file as it was
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return model


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def upstream(request, module_tmp, sp_model):
    directory = module_tmp(f"pangu_{request.param}")
    model = make_upstream_checkpoint(directory, TINY_CONFIGS[request.param], sp_model)
    return request.param, directory, model


# ------------------------------------------------------------------------------------------ (a) same model
@needs_fixture
def test_native_load_matches_upstream(upstream, caplog):
    from transformers import LlamaForCausalLM

    name, directory, ref = upstream
    fields = {**openpangu.UPSTREAM_DEFAULTS, **TINY_CONFIGS[name]}
    with caplog.at_level(logging.INFO, logger="qat_app"):
        model, tok = load_causal_lm(str(directory), dtype="float32", trust_remote_code=True)
    assert type(model) is LlamaForCausalLM and model.config.model_type == "llama"
    assert not hasattr(model.config, "auto_map") or not model.config.auto_map
    infos = [r.getMessage() for r in caplog.records if "openPangu" in r.getMessage()]
    assert len(infos) == 1 and "trust_remote_code" in infos[0], infos
    # the mapped config
    cfg = model.config
    assert cfg.attention_bias is fields["bias"] and cfg.mlp_bias is False
    assert cfg.rms_norm_eps == fields["rms_norm_eps"] and cfg.rope_parameters["rope_theta"] == fields["rope_theta"]
    assert cfg.head_dim == fields.get("head_dim", 64 // 4) and cfg.num_key_value_heads == fields["num_key_value_heads"]
    assert cfg.tie_word_embeddings is fields["tie_word_embeddings"]
    assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (
        fields["pad_token_id"], fields["bos_token_id"], fields["eos_token_id"])
    # the same tensors under the same names
    ref_sd, sd = ref.state_dict(), model.state_dict()
    assert set(sd) == set(ref_sd)
    for key in ref_sd:
        assert torch.equal(sd[key], ref_sd[key]), key
    if fields["tie_word_embeddings"]:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        assert model.lm_head.weight is not model.model.embed_tokens.weight
    # the same function
    ids, mask = _inputs(cfg.vocab_size)
    want, got = _logits(ref, ids, mask), _logits(model, ids, mask)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    assert tok.eos_token_id == EOS_ID and tok.pad_token_id == 0 and tok.bos_token_id == 1


@needs_fixture
def test_same_quantized_layout_and_function(upstream):
    name, directory, ref = upstream
    model, _ = load_causal_lm(str(directory))
    ref = copy.deepcopy(ref)
    quant = QuantConfig(high_precision_layers=1, amax_algo="current", fused="off")
    want, got = quantize_model(ref, quant), quantize_model(model, quant)
    assert got.modules == want.modules and got.num_params == want.num_params
    assert got.quantized_blocks == want.quantized_blocks == [1, 2, 3]
    assert got.num_linears == 9
    hif8 = lambda m: sorted(n for n, mod in m.named_modules() if isinstance(mod, HiF8Linear))  # noqa: E731
    assert hif8(model) == hif8(ref)
    ids, mask = _inputs(model.config.vocab_size)
    assert torch.allclose(_logits(model, ids, mask), _logits(ref, ids, mask), atol=1e-5, rtol=1e-5)


@needs_fixture
def test_hub_id_takes_the_native_path(tmp_path, sp_model, monkeypatch):
    """A hub id whose downloaded config.json is openPangu's goes the same way (the download is faked here)."""
    import huggingface_hub
    from transformers import LlamaForCausalLM

    directory = tmp_path / "pangu"
    make_upstream_checkpoint(directory, TINY_CONFIGS["nobias"], sp_model)
    downloads, calls = [], []
    monkeypatch.setattr(huggingface_hub, "hf_hub_download",
                        lambda repo, name, **kw: (downloads.append((repo, name, kw)), str(directory / name))[1])
    real_model, real_tok = openpangu.load_model, openpangu.load_tokenizer

    def fake_model(src, config, **kw):
        calls.append(("model", src, kw["local"]))
        return real_model(str(directory), config, **{**kw, "local": True})

    def fake_tok(src, **kw):
        calls.append(("tokenizer", src, kw["local"]))
        return real_tok(str(directory), **{**kw, "local": True})

    monkeypatch.setattr(openpangu, "load_model", fake_model)
    monkeypatch.setattr(openpangu, "load_tokenizer", fake_tok)
    model, _ = load_causal_lm("some-org/openPangu-tiny", trust_remote_code=True, revision="main")
    assert type(model) is LlamaForCausalLM
    assert calls == [("tokenizer", "some-org/openPangu-tiny", False), ("model", "some-org/openPangu-tiny", False)]
    assert {(repo, name, kw.get("revision")) for repo, name, kw in downloads} == {("some-org/openPangu-tiny", "config.json", "main")}


def test_config_mapping_table():
    cfg = openpangu.llama_config({"model_type": "PanguEmbedded", "hidden_size": 64, "num_attention_heads": 4,
                                  "num_key_value_heads": None, "head_dim": None, "rope_scaling": {"type": "linear", "factor": 2.0}})
    d = openpangu.UPSTREAM_DEFAULTS
    assert cfg.attention_bias is True and cfg.mlp_bias is False  # upstream default bias=True
    assert cfg.num_key_value_heads == 4 and cfg.head_dim == 16
    assert cfg.rms_norm_eps == d["rms_norm_eps"] == 1e-5 and cfg.vocab_size == 153376
    assert cfg.eos_token_id == 45892 and cfg.max_position_embeddings == 32768 and cfg.tie_word_embeddings is False
    assert cfg.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 16000000.0}
    assert openpangu.is_openpangu_config({"architectures": ["PanguEmbeddedForCausalLM"]})
    assert not openpangu.is_openpangu_config({"model_type": "llama"})
    with pytest.raises(openpangu.OpenPanguError, match="partial_rotary_factor"):
        openpangu.llama_config({"partial_rotary_factor": 0.5})


@needs_fixture
def test_dropped_bias_or_missing_tensor_is_a_clear_error(tmp_path, sp_model, monkeypatch):
    directory = tmp_path / "pangu"
    make_upstream_checkpoint(directory, TINY_CONFIGS["explicit"], sp_model)
    # a mapping that dropped the attention bias must not load silently
    broken = {k: v for k, v in openpangu.FIELD_MAP.items() if k != "bias"}
    monkeypatch.setattr(openpangu, "FIELD_MAP", broken)
    monkeypatch.setitem(openpangu.UPSTREAM_DEFAULTS, "bias", False)
    with pytest.raises(openpangu.OpenPanguError, match=rf"{re.escape(str(directory))}.*unexpected.*q_proj\.bias"):
        load_causal_lm(str(directory))
    monkeypatch.undo()
    # a checkpoint without one of its tensors
    from safetensors.torch import load_file, save_file

    weights = directory / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["model.layers.2.self_attn.k_proj.bias"]
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.raises(openpangu.OpenPanguError, match=r"missing.*model\.layers\.2\.self_attn\.k_proj\.bias"):
        load_causal_lm(str(directory))
    weights.unlink()
    with pytest.raises(openpangu.OpenPanguError, match="no loadable weights"):
        load_causal_lm(str(directory))


# ------------------------------------------------------------------------------------------ (b) tokenizer
TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "Hello World, with Capitals and 12345 digits!",
    "  leading, trailing  and  double  spaces  ",
    "line\nbreak\tand tab",
    "unicode: ünïcödé 中文 🙂 ＡＢＣ ﬁ",
    "a[unused10]b and x [unused9] y[unused10]",
    "▁already escaped",
]


@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_tokenizer_encodes_like_upstream_and_round_trips(tmp_path, model_type, sp_model):
    import sentencepiece as spm

    blob = sp_model if model_type == "bpe" else train_sentencepiece("unigram")
    sp = spm.SentencePieceProcessor(model_proto=blob)
    directory = tmp_path / "tok"
    write_upstream_tokenizer(directory, blob)  # tokenizer files only: detected by tokenizer_class PanguTokenizer
    (directory / "config.json").write_text(json.dumps({"model_type": "PanguEmbedded", "vocab_size": len(sp)}))
    # trust_remote_code=True would run the (absent) tokenization_openpangu.py: the native path must not
    tok = load_tokenizer(str(directory), trust_remote_code=True)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (1, EOS_ID, 0, 0)
    assert tok.eos_token == "[unused10]" and tok.padding_side == "right"
    for text in TEXTS:
        assert tok(text)["input_ids"] == upstream_encode(sp, text), text
    for text in TEXTS[:2]:  # text SentencePiece's normalizer leaves alone comes back as it was
        assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text
    for text in TEXTS[2:5]:
        assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == sp.decode(sp.encode(text))
    batch = tok(["one two", "three"], padding=True, return_tensors="pt")
    assert batch["input_ids"].shape[0] == 2 and (batch["input_ids"][1, -1] == 0)
    (directory / "config.json").unlink()  # a tokenizer-only copy is recognised by its tokenizer_config.json
    assert load_tokenizer(str(directory))(TEXTS[2])["input_ids"] == upstream_encode(sp, TEXTS[2])


def test_tokenizer_needs_its_model_file(tmp_path, sp_model):
    directory = tmp_path / "tok"
    write_upstream_tokenizer(directory, sp_model)
    (directory / "tokenizer.model").unlink()
    with pytest.raises(openpangu.OpenPanguError, match="no tokenizer.model"):
        load_tokenizer(str(directory))


# ------------------------------------------------------------------------------------------ (c) the paper's layout
# openPangu-Embedded-1B as its config.json describes it (qat_app.openpangu), with its remote-code map
OPENPANGU_1B = {**openpangu.OPENPANGU_EMBEDDED_1B, "auto_map": AUTO_MAP}


def test_openpangu_1b_layout_on_meta_device():
    with torch.device("meta"):
        model = openpangu.model_from_config(OPENPANGU_1B)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.o_proj.bias is not None
    assert (attn.k_proj.out_features, attn.o_proj.in_features) == (6 * 128, 1536)
    assert_paper_layout(model)
    assert not isinstance(attn.q_proj, HiF8Linear)


# ------------------------------------------------------------------------------------------ (d) HF export
@needs_fixture
def test_hf_export_is_a_plain_llama_directory(tmp_path, sp_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qat_app.export.hf import export_hf
    from qat_app.module import QATModule

    directory = tmp_path / "pangu"
    ref = make_upstream_checkpoint(directory, TINY_CONFIGS["explicit"], sp_model)
    module = QATModule(model_name=str(directory), trust_remote_code=True,
                       quant=QuantConfig(high_precision_layers=1, fused="off"))
    out = export_hf(module, tmp_path / "export")
    assert not list(out.glob("*.py"))  # no remote code travels with it
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == "llama" and "auto_map" not in saved and saved["attention_bias"] is True
    assert "auto_map" not in json.loads((out / "tokenizer_config.json").read_text())
    plain = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)  # no trust_remote_code
    assert type(plain).__name__ == "LlamaForCausalLM"
    ids, mask = _inputs(plain.config.vocab_size)
    assert torch.allclose(_logits(plain, ids, mask), _logits(ref, ids, mask), atol=1e-5, rtol=1e-5)
    tok = AutoTokenizer.from_pretrained(str(out))
    for text in TEXTS:
        assert tok(text)["input_ids"] == module.tokenizer(text)["input_ids"]


@pytest.mark.slow
@needs_fixture
def test_served_by_vllm_as_the_llama_it_loads_as(module_tmp, sp_model):
    """openPangu-Embedded (attention bias, GQA) trained natively, exported in FP8 as a Llama, served by vLLM:
    the engine's log-probs meet the emulation's bound (head size 32, as vLLM's CPU attention takes)."""
    from qat_app.export import engine_check

    if not (engine_check.DEFAULT_VENV / "bin" / "python").is_file():
        pytest.skip(f"no vLLM environment at {engine_check.DEFAULT_VENV} (make vllm-env)")
    from qat_app.config import QuantConfig
    from qat_app.export.compressed import export_compressed_tensors
    from qat_app.hif8.scaling import all_scalers
    from qat_app.module import QATModule

    directory = module_tmp("pangu_served")
    make_upstream_checkpoint(directory, dict(BASE, num_key_value_heads=2, head_dim=32, bias=True), sp_model)
    module = QATModule(model_name=str(directory), quant=QuantConfig(high_precision_layers=2, fused="off", history_len=4))
    vocab = module.model.config.vocab_size
    module.model.train()
    for _ in range(2):
        with torch.no_grad():
            module.model(input_ids=torch.randint(5, vocab, (2, 12)))
        for s in all_scalers(module.model):
            s.advance()
    module.model.eval()
    report = export_compressed_tensors(module, directory / "fp8")
    exported = json.loads((directory / "fp8" / "config.json").read_text())
    assert exported["architectures"] == ["LlamaForCausalLM"] and exported["attention_bias"] is True
    assert report["totals"]["fp8_layers"] == 6
    torch.manual_seed(2)
    check = engine_check.check_with_engine(module, directory / "fp8", [torch.randint(5, vocab, (2, 16))],
                                           python=engine_check.engine_python(), top_k=10, max_tokens=4)
    assert set(check.kernels) == {"CompressedTensorsW8A8Fp8"}  # on a CPU without AMX: the torch kernel only
    assert check.kernels["CompressedTensorsW8A8Fp8"] in engine_check.expected_cpu_kernels()
    assert check.emulation_within_bound and check.trained.coverage > 0
