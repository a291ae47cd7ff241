"""Quantization-aware distillation's numeric core: the chunked KL and CE against a few-line reference (values and
gradients), the LM head's logits as each supported architecture computes them, the teacher's checks, the settings."""

import pytest
import torch

from qat_app.config import QuantConfig, quantize_model
from qat_app.distill import DISTILL_CE, DISTILL_KL, DistillConfig, Teacher, distill_losses, final_hidden, head_logits
from qat_app.distill.loss import chunk_rows
from qat_app.errors import CheckpointError, ConfigError
from tests._architectures import CASES, VOCAB, build


def _reference(student, teacher, ids, labels, temperature):
    """KL(teacher_T || student_T) per labelled position and transformers' own CE, from whole logits."""
    s = student(input_ids=ids).logits[:, :-1].float()
    with torch.no_grad():
        t = teacher(input_ids=ids).logits[:, :-1].float()
    target = labels[:, 1:]
    mask = target != -100
    log_t, log_s = torch.log_softmax(t / temperature, -1), torch.log_softmax(s / temperature, -1)
    kl = (log_t.exp() * (log_t - log_s)).sum(-1)[mask].mean()
    ce = student(input_ids=ids, labels=labels).loss
    return kl, ce


@pytest.mark.parametrize("temperature,chunk", [(1.0, 3), (2.0, 0), (0.5, 1000)])
def test_chunked_kl_and_ce_equal_whole_logits_in_value_and_gradient(temperature, chunk):
    student = build("llama", seed=0)
    quantize_model(student, QuantConfig(high_precision_layers=2, fused="off"))
    teacher = build("llama", seed=1).eval()  # another model: a KL well above 0
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :4] = -100  # positions without a target (a document boundary, padding)
    labels[1, -1] = -100

    kl_ref, ce_ref = _reference(student, teacher, ids, labels, temperature)
    (kl_ref + 0.3 * ce_ref).backward()
    grads_ref = {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}
    student.zero_grad()

    with torch.no_grad():
        teacher_hidden = final_hidden(teacher, ids)
    losses = distill_losses(student, teacher, final_hidden(student, ids), teacher_hidden, labels, temperature, chunk)
    kl, ce = losses.means()
    assert int(losses.tokens) == int((labels[:, 1:] != -100).sum()) == 12  # 8 - 3 and 8 - 1
    torch.testing.assert_close(kl, kl_ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ce, ce_ref, rtol=1e-5, atol=1e-7)
    assert kl > 1e-3  # two random models: small, but far above float rounding
    (kl + 0.3 * ce).backward()
    for name, p in student.named_parameters():
        if name in grads_ref:
            torch.testing.assert_close(p.grad, grads_ref[name], rtol=1e-4, atol=1e-6, msg=name)
    assert all(p.grad is None for p in teacher.parameters())


def test_a_model_against_itself_has_kl_zero():
    model = build("llama").eval()
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    hidden = final_hidden(model, ids)
    kl, _ = distill_losses(model, model, hidden, hidden, ids, 1.0, 2).means()
    assert float(kl.detach().abs()) < 1e-6


@pytest.mark.parametrize("model_type", CASES)
def test_the_heads_logits_are_the_models_own_on_every_architecture(model_type):
    """Soft-capping (Gemma 2/3), logit scaling (Granite) and tied heads included."""
    model = build(model_type).eval()
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
        got = head_logits(model, final_hidden(model, ids))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_chunks_keep_one_models_logits_under_the_budget():
    assert chunk_rows(153_376) == 218  # the paper's vocabulary: 218 x 153,376 < 2^25 values
    assert chunk_rows(49_152) == 682 and chunk_rows(10, chunk_tokens=5) == 5


def test_the_initial_teacher_is_a_frozen_copy_and_a_resume_checks_it():
    student = build("llama")
    teacher = Teacher.initial(student)
    assert teacher.model is not student and not any(p.requires_grad for p in teacher.model.parameters())
    assert all(p.requires_grad for p in student.parameters())
    Teacher.initial(build("llama")).check_resumed(teacher.state())  # the same weights: accepted
    with pytest.raises(CheckpointError, match="distill.teacher: the checkpoint was distilled from 'initial'"):
        Teacher.initial(build("llama", seed=1)).check_resumed(teacher.state())


def test_a_teacher_with_another_vocabulary_or_tokenizer_is_refused(tmp_path):
    from transformers import AutoModelForCausalLM

    from qat_app.distill.teacher import check_same_tokenizer
    from qat_app.models import load_tokenizer
    from tests._tiny_models import byte_level_tokenizer

    student = build("llama")
    config = build("llama").config
    config.vocab_size = VOCAB + 8
    wider = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ConfigError, match=r"distill.teacher: other predicts 72 tokens, the student 64"):
        check_same_tokenizer("other", None, None, wider, student)
    with pytest.raises(ConfigError, match="distill.teacher: other has another tokenizer"):
        check_same_tokenizer("other", byte_level_tokenizer(), load_tokenizer(), student, student)


@pytest.mark.parametrize("settings,message", [
    (dict(kl_weight=-1.0), "distill.kl_weight: must be >= 0, got -1.0"),
    (dict(ce_weight=-0.5), "distill.ce_weight: must be >= 0, got -0.5"),
    (dict(temperature=0.0), "distill.temperature: must be > 0, got 0.0"),
    (dict(enabled=True, kl_weight=0.0, ce_weight=0.0), "both 0 leaves no loss"),
    (dict(chunk_tokens=-2), "distill.chunk_tokens: must be an integer >= 0"),
    (dict(teacher=" "), "distill.teacher: 'initial' or a model directory"),
])
def test_bad_settings_are_one_line_naming_the_field(settings, message):
    with pytest.raises(ConfigError, match=message):
        DistillConfig(**settings)
    with pytest.raises(ConfigError, match="distill.kl: not a distillation setting"):
        DistillConfig.coerce({"kl": 1.0})
    assert DistillConfig.coerce(None) == DistillConfig() and not DistillConfig().enabled


@pytest.mark.parametrize("variant,base,runs", [("quickstart_qad", "quickstart", "runs/quickstart"),
                                               ("qad", "exp8", "runs/exp8")])
def test_the_distillation_configs_differ_from_their_base_in_the_distillation_settings_alone(variant, base, runs):
    """So that a run of each compares cleanly: the same data, steps, seeds and recipe; its own run directory."""
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[1] / "configs"
    distilled = yaml.safe_load((root / f"{variant}.yaml").read_text().replace(f"runs/{variant}", runs))
    settings = distilled["model"].pop("distill")
    assert distilled == yaml.safe_load((root / f"{base}.yaml").read_text())
    assert DistillConfig(**settings).enabled and settings["teacher"] == "initial"


def test_the_dashboard_shows_the_distillation_chart_for_a_distilled_run_only():
    from types import SimpleNamespace

    from callbacks.dashboard import DISTILL_CHART, LAYOUT, layout_for

    def trainer(teacher):
        return SimpleNamespace(callbacks=[], datamodule=None, lightning_module=SimpleNamespace(teacher=teacher))

    assert LAYOUT["training"][DISTILL_CHART][1] == ["distill/kl$", "distill/ce$"]
    assert DISTILL_CHART in layout_for(trainer(object()))["training"]
    assert DISTILL_CHART not in layout_for(trainer(None))["training"]


def test_the_report_compares_a_distilled_runs_next_token_loss_and_shows_its_kl(tmp_path):
    from qat_app.report.runs import load_run
    from qat_app.report.tables import _render_training_loss

    logs = tmp_path / "logs" / "version_0"
    logs.mkdir(parents=True)
    (logs / "metrics.csv").write_text("step,train/loss,distill/kl,distill/ce\n0,0.5,0.01,2.5\n1,0.25,0.02,2.25\n")
    run = load_run(tmp_path, label="qad")
    assert run.train_loss() == {0: 2.5, 1: 2.25}  # its CE, comparable with a QAT run's train/loss
    lines = _render_training_loss(run, [{"label": "qad", "train_loss_ape_pct": 0.0, "ape_common_steps": 2,
                                         "final_train_loss": 2.25, "final_val_loss": None,
                                         "distill": {"kl": run.last(DISTILL_KL), "ce": run.last(DISTILL_CE)}}], 0)
    assert "| `qad` | 0.0200 | 2.2500 |" in lines


def test_neither_models_whole_logits_ever_exist_in_forward_or_backward():
    """Every tensor any op makes while the chunked loss runs forward and backward is smaller than one model's
    (tokens x vocabulary) logits: only a chunk's logits exist at a time."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    Largest.largest = max(Largest.largest, t.numel())
            return out

    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=1024, max_position_embeddings=64)
    torch.manual_seed(0)
    student, teacher = LlamaForCausalLM(config), LlamaForCausalLM(config).eval()
    ids = torch.randint(3, 1024, (2, 41), generator=torch.Generator().manual_seed(3))
    whole = ids.numel() * 1024  # one model's logits: 82 x 1024
    with Largest():
        with torch.no_grad():
            teacher_hidden = final_hidden(teacher, ids)
        kl, ce = distill_losses(student, teacher, final_hidden(student, ids), teacher_hidden, ids, 1.0, 8).means()
        (kl + ce).backward()
    # the largest left: the head's and embeddings' weight gradients (vocabulary x hidden)
    assert Largest.largest == 1024 * 32 < whole


def test_a_report_pairs_a_distilled_run_with_its_plain_qat_run():
    """Distillation is what such a report compares, as quantization is: not a mismatch of the pair."""
    from qat_app.report.compare import config_differences

    base = {"model": {"lr": 1e-5, "distill": {"enabled": False}}}
    assert config_differences(base, {"model": {"lr": 1e-5, "distill": {"enabled": True, "ce_weight": 0.1}}}) == []
    assert config_differences(base, {"model": {"lr": 1e-4, "distill": {"enabled": True}}}) == ["model.lr: 1e-05 vs 0.0001"]
