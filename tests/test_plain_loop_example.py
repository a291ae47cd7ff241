"""examples/plain_pytorch_loop.py: the recipe through the core's public API alone, no Lightning."""

import importlib.util
import os
import subprocess
import sys

import torch
from qat_app.hif8.operand import Operand

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATH = os.path.join(ROOT, "examples", "plain_pytorch_loop.py")


def load_example():
    spec = importlib.util.spec_from_file_location("plain_pytorch_loop", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_runs_the_recipe_with_the_public_api():
    from qat_app.hif8 import quantized_linears

    model, losses = load_example().run(steps=6, warmup=2, history_len=4, high_precision_layers=2)
    layers = quantized_linears(model)
    assert len(layers) == 3 * 4  # gate/up/down of blocks 1-4 of 6
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    for _, layer in layers:
        assert layer.quantizes(Operand.WEIGHT) and layer.quantizes(Operand.INPUT)  # switched on at the end of the warmup
        for scaler in (layer.input_scaler, layer.weight_scaler):
            assert int(scaler.steps_recorded) == 6 and not scaler.uses_current_scaling
            assert int(scaler.quantized_steps) == 4  # steps 2..5


def test_the_core_imports_no_lightning_and_no_app():
    code = ("import sys; import qat_app.hif8, qat_app.hif8.training; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning', 'callbacks') "
            "or (m.startswith('qat_app.') and not m.startswith('qat_app.hif8'))]; print(bad); assert not bad")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_example_applies_the_fallback_policy_from_a_plain_loop():
    from qat_app.hif8 import FallbackPolicy, fallen_back

    # at lr 3e-2 the tiny model's activations outgrow their delayed scales step after step (so many at once that
    # the default budget would call it the recipe's problem and decide nothing: no budget here)
    model, losses = load_example().run(steps=10, warmup=2, lr=3e-2, history_len=2, high_precision_layers=2,
                                       fallback=FallbackPolicy(window=3, min_events=2, max_tensors=None))
    decisions = fallen_back(model)
    assert decisions and all(d["target"] == "current" and d["step"] >= 3 for d in decisions)
    for d in decisions:
        assert model.get_submodule(d["module"]).scaler_of(d["operand"]).algo == "current"
