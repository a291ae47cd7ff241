"""The amax estimators are one table (qat_app/hif8/estimators.py): each entry's a_hat equals the paper's definition
worked out independently, and a fifth estimator added as one entry (nothing else edited) is a recipe choice, a
scaler's a_hat, a what-if column counted exactly, and a style in the report's figure."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from qat_app.hif8 import estimators
from qat_app.hif8.estimators import AMAX_ALGOS, DELAYED_ALGOS, ESTIMATORS, delayed_estimates, own_estimate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_each_delayed_estimate_is_its_definition():
    history = torch.tensor([[2.0, 1.0, 4.0], [0.5, 3.0, 0.25]])  # newest first
    smoothed = torch.tensor([1.5, 0.75])
    got = delayed_estimates(history, smoothed)
    expected = {"most_recent": [2.0, 0.5], "exp_smooth": [1.5, 0.75], "max": [4.0, 3.0]}
    assert DELAYED_ALGOS == ("most_recent", "exp_smooth", "max")
    assert {algo: got[:, k].tolist() for k, algo in enumerate(DELAYED_ALGOS)} == expected
    # current scaling logs the most recent amax as its a_hat; every other estimator its own estimate
    assert [DELAYED_ALGOS[own_estimate(a)] for a in AMAX_ALGOS] == ["most_recent", "exp_smooth", "max", "most_recent"]


def test_every_estimator_has_a_glossary_line_and_a_style_of_its_own():
    glossary = open(os.path.join(ROOT, "docs", "glossary.md")).read()
    assert all(f"`{e.name}`" in glossary for e in ESTIMATORS)
    assert len({e.style for e in ESTIMATORS}) == len(ESTIMATORS)


FIFTH = '    Estimator("mean", lambda history, smoothed: history.mean(dim=-1), "mean", True, ("tab:red", (0, (1, 1)))),\n'
# loads the estimators module with one more entry before anything imports it, then uses it end to end
SCRIPT = r"""
import importlib.util, json, sys
path, fifth = sys.argv[1], sys.argv[2]
source = open(path).read().replace('    Estimator("current"', fifth + '    Estimator("current"', 1)
module = importlib.util.module_from_spec(importlib.util.spec_from_loader("qat_app.hif8.estimators", loader=None))
sys.modules["qat_app.hif8.estimators"] = module  # before it runs: its dataclass looks itself up there
exec(compile(source, path, "exec"), module.__dict__)

import torch
from qat_app.config import QuantConfig
from qat_app.hif8.fake_quant import compute_scale, saturated_mask
from qat_app.hif8.health import WHATIF_ALGOS
from qat_app.hif8.linear import HiF8Linear
from qat_app.report.health_figures import ESTIMATOR_STYLE

layer = HiF8Linear(16, 8, bias=False, **QuantConfig(amax_algo="mean", history_len=3, fused="off").layer_options())
for amax in (5.0, 4.0, 1.0, 2.0):  # recorded steps: the window keeps the last three
    layer.input_scaler.observe(torch.tensor(amax), None, 1)
    layer.input_scaler.advance()
x = torch.randn(12, 16, generator=torch.Generator().manual_seed(0)) * 1.6
layer(x)
scaler = layer.input_scaler
independent = {}
for algo, a_hat in (("most_recent", 2.0), ("exp_smooth", None), ("max", 4.0), ("mean", 7.0 / 3.0)):
    if a_hat is not None:
        scale = compute_scale(torch.tensor(a_hat, dtype=torch.float32), 15.0, 0.0, torch.tensor(1.0))
        independent[algo] = int(saturated_mask(x, scale, 15.0, "hif8").sum())
counts = dict(zip(WHATIF_ALGOS, scaler.step_whatif_clipped.tolist()))
print(json.dumps({"algos": list(WHATIF_ALGOS), "a_hat": float(scaler.a_hat), "counts": counts,
                  "independent": independent, "clipped": int(scaler.step_clipped),
                  "style": "mean" in ESTIMATOR_STYLE}))
"""


def test_a_fifth_estimator_is_one_entry_of_the_table():
    done = subprocess.run([sys.executable, "-c", SCRIPT, estimators.__file__, FIFTH], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["algos"] == ["most_recent", "exp_smooth", "max", "mean", "current"]
    assert abs(out["a_hat"] - 7.0 / 3.0) < 1e-6  # the scaler's own a_hat: the window's mean (float32)
    for algo, count in out["independent"].items():  # each what-if column, counted exactly
        assert out["counts"][algo] == count, algo
    assert out["counts"]["mean"] == out["clipped"]  # the own estimator counts what the real counter counts
    assert out["style"]
