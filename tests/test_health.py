"""Numeric health of a quantized tensor (qat_app.hif8.health): SQNR, precision tiers, underflow, outlier factor.

The reference is a few lines on en_dtypes' hifloat8 (the format's reference implementation), written without
our rounding code; E4M3 / E5M2 against torch's float8 casts. Then the plumbing: health is measured only while
the switch is on (logging steps), summed over micro-batches, never in eval mode, with no host sync on the
forward or backward; and a fit through main.py logs the health and what-if metrics and writes them to the
saturation summary.
"""

from __future__ import annotations

import csv
import json
import math
import os

import numpy as np
import pytest
import torch

from qat_app.config import QuantConfig
from qat_app.hif8.formats import get_format
from qat_app.hif8.health import (FIELDS, HIST_OFFSET, TIER_OFFSET, TIERS, WHATIF_ALGOS, measure_health,
                                 summarize)
from qat_app.hif8.linear import HiF8Linear
from qat_app.hif8.quantized import set_health_measurement

en_dtypes = pytest.importorskip("en_dtypes")


def field(vector: torch.Tensor, name: str) -> float:
    return float(vector[FIELDS.index(name)])


def reference_health(x: torch.Tensor, scale: float, max_val: float = 15.0) -> dict:
    """SQNR, tier counts and underflow of x quantized with ``scale``, on en_dtypes.hifloat8 and numpy alone."""
    xf = x.float().numpy()
    q = np.clip(xf * np.float32(scale), -max_val, max_val).astype(en_dtypes.hifloat8).astype(np.float32)
    dequantized = torch.from_numpy(q / np.float32(scale)).to(x.dtype).double().numpy()
    signal = xf.astype(np.float64)
    sqnr = 10 * math.log10(np.sum(signal**2) / np.sum((signal - dequantized) ** 2))
    exponent = np.frexp(np.abs(q))[1] - 1  # |q| = m 2^e, m in [1, 2)
    tiers = {"zero": q == 0, "denormal": (q != 0) & (np.abs(q) < 2.0**-15)}
    normal = np.abs(q) >= 2.0**-15
    tiers |= {"mant3": normal & (np.abs(exponent) <= 3), "mant2": normal & (np.abs(exponent) >= 4) & (np.abs(exponent) <= 7),
              "mant1": normal & (np.abs(exponent) >= 8)}
    return {"sqnr_db": sqnr, "tiers": {k: int(v.sum()) for k, v in tiers.items()},
            "underflow": int(((xf != 0) & (q == 0)).sum()), "dequantized": dequantized}


def mixed_tensor(n: int = 20_000, seed: int = 0) -> torch.Tensor:
    """Values over many binades (every tier after scaling by 7.5), outliers that clip, zeros, tiny values."""
    g = torch.Generator().manual_seed(seed)
    magnitude = torch.exp2(torch.empty(n).uniform_(-28, 1.2, generator=g))
    x = magnitude * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    x[:50] = 0.0
    x[50:60] = torch.linspace(2.1, 4.0, 10)  # clipped at a_hat 2
    return x[torch.randperm(n, generator=g)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sqnr_tiers_and_underflow_equal_an_en_dtypes_reference(dtype):
    x = mixed_tensor().to(dtype)
    scale = torch.tensor(15.0 / 2.0)
    fmt = get_format("hif8")
    want = reference_health(x, float(scale))
    got = measure_health(x, scale, 15.0, fmt)  # its error is against its own q / scale: the SQNR checks that too
    assert field(got, "numel") == x.numel()
    assert [int(got[TIER_OFFSET + k]) for k in range(len(TIERS))] == [want["tiers"][t] for t in TIERS]
    assert all(want["tiers"][t] > 0 for t in TIERS)  # every tier is exercised
    assert field(got, "underflow") == want["underflow"] > 0
    assert float(summarize(got[None], x.float().abs().max()[None])["sqnr_db"][0]) == pytest.approx(want["sqnr_db"], rel=1e-12)
    assert float(got[HIST_OFFSET:].sum()) == x.numel() and float(got[HIST_OFFSET]) == 50  # bin 0: the zeros


def test_compiled_health_equals_the_plain_one():
    """fused="on" (torch.compile, also what the Triton path uses): the same counts and histogram, the float64
    sums to their last bits; with stochastic rounding's noise too."""
    fmt = get_format("hif8")
    x = mixed_tensor(4000, seed=2).view(40, 100)
    scale = torch.tensor(15.0 / 2.0)
    noise = torch.randint(0, 1 << 23, x.shape, dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    for bits in (None, noise):
        plain = measure_health(x, scale, 15.0, fmt, bits, fused="off")
        compiled = measure_health(x, scale, 15.0, fmt, bits, fused="on")
        sums = [FIELDS.index("sum_x2"), FIELDS.index("sum_err2")]
        counts = [k for k in range(plain.numel()) if k not in sums]
        assert torch.equal(compiled[counts], plain[counts])
        torch.testing.assert_close(compiled[sums], plain[sums], rtol=1e-15, atol=0)
    assert field(plain, "underflow") > 0
    assert not torch.equal(plain, measure_health(x, scale, 15.0, fmt))  # q used the noise


def test_layer_measures_what_the_reference_measures():
    """Through a HiF8Linear forward (delayed scale from a recorded amax): the input's health vector is the
    reference's for the scale the layer used, and its dequantized tensor is the layer's."""
    layer = HiF8Linear(64, 4, bias=False, **QuantConfig(amax_algo="max", history_len=2, fused="off").layer_options())
    layer.input_scaler.observe(torch.tensor(2.0), None, 1)
    layer.input_scaler.advance()
    set_health_measurement(layer, True)
    x = mixed_tensor(64 * 40, seed=3).view(40, 64)
    layer(x)
    want = reference_health(x, float(layer.input_scaler.scale))
    got = layer.input_scaler.health_step
    assert [int(got[TIER_OFFSET + k]) for k in range(len(TIERS))] == [want["tiers"][t] for t in TIERS]
    assert field(got, "underflow") == want["underflow"]
    sqnr = 10 * math.log10(field(got, "sum_x2") / field(got, "sum_err2"))
    assert sqnr == pytest.approx(want["sqnr_db"], rel=1e-12)


def test_underflow_counts_planted_tiny_values():
    """After scaling by 7.5: below 2^-23 rounds to 0 (underflow), 2^-23 and above round to the smallest denormal
    2^-22 (not underflow); exact zeros are zeros, not underflow."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g)
    scale = torch.tensor(7.5)
    tiny = torch.tensor([2.0**-24, 2.0**-30, -2.0**-25, 1e-20, -1e-38]) / 7.5
    kept = torch.tensor([2.0**-23, 2.0**-22, -1.5 * 2.0**-23]) / 7.5
    x[:5], x[5:8], x[8:20] = tiny, kept, 0.0
    fmt = get_format("hif8")
    got = measure_health(x, scale, 15.0, fmt)
    assert field(got, "underflow") == 5
    assert int(got[TIER_OFFSET + TIERS.index("zero")]) == 5 + 12
    assert int(got[TIER_OFFSET + TIERS.index("denormal")]) == 3
    assert float(summarize(got[None], x.abs().max()[None])["underflow_frac"][0]) == 5 / 1000


@pytest.mark.parametrize("seed", range(3))
def test_outlier_factor_is_exact_to_the_histogram_resolution(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(30_000, generator=g) * torch.rand((), generator=g) * 5
    x[:7] = torch.tensor([40.0, -25.0, 18.0, 60.0, 33.0, -90.0, 12.0])  # outliers
    fmt = get_format("hif8")
    scale = torch.tensor(15.0) / x.abs().max()
    got = measure_health(x, scale, 15.0, fmt)
    magnitudes = np.sort(np.abs(x.numpy()))
    p999 = magnitudes[math.ceil(0.999 * x.numel()) - 1]  # the p99.9 element from the smallest
    exact = float(x.abs().max()) / p999
    factor = float(summarize(got[None], x.abs().max()[None])["outlier_factor"][0])
    assert exact <= factor < exact * 1.125  # the bin's lower edge: never below, at most one bin width above
    assert factor > 1.5  # the outliers show


@pytest.mark.parametrize("name,normal_tier", [("e4m3", "mant3"), ("e5m2", "mant2")])
def test_float8_formats_have_a_normal_a_denormal_and_a_zero_tier(name, normal_tier):
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[name]
    x = mixed_tensor(5000, seed=1)
    scale = torch.tensor(15.0 / 2.0)
    q = (x * scale).clamp(-15, 15).to(dtype).float()
    fmt = get_format(name)
    got = measure_health(x, scale, 15.0, fmt)
    smallest_normal = torch.finfo(dtype).smallest_normal
    want = {normal_tier: int((q.abs() >= smallest_normal).sum()), "denormal": int(((q != 0) & (q.abs() < smallest_normal)).sum()),
            "zero": int((q == 0).sum())}
    assert {t: int(got[TIER_OFFSET + k]) for k, t in enumerate(TIERS)} == {t: want.get(t, 0) for t in TIERS}
    assert all(v > 0 for v in want.values())


def tiny_layer(**quant) -> HiF8Linear:
    torch.manual_seed(0)
    layer = HiF8Linear(16, 8, **QuantConfig(amax_algo="max", history_len=2, fused="off", **quant).layer_options())
    for scaler in layer.scalers():
        scaler.observe(torch.tensor(1.0), None, 1)
        scaler.advance()
    return layer


def test_health_is_measured_only_while_switched_on_and_summed_over_micro_batches():
    layer = tiny_layer(quantize_grads=True, grad_stochastic_rounding=True)
    x1, x2 = torch.randn(4, 16), torch.randn(6, 16)
    layer(x1).sum().backward()
    assert all(s.health_step is None for s in layer.scalers())  # off: nothing measured
    for scaler in layer.scalers():
        scaler.advance()
    set_health_measurement(layer, True)
    layer.eval()
    layer(x1)
    assert all(s.health_step is None for s in layer.scalers())  # eval mode: never
    layer.train()
    layer(x1).sum().backward()
    first = layer.input_scaler.health_step.clone()
    layer(x2).sum().backward()  # a second micro-batch of the same step
    scale = layer.input_scaler.scale
    fmt = layer.format
    second = measure_health(x2, scale, 15.0, fmt)
    torch.testing.assert_close(layer.input_scaler.health_step, first + second, rtol=1e-15, atol=0)
    assert field(layer.weight_scaler.health_step, "numel") == layer.weight.numel()  # the weight: once per step
    assert field(layer.grad_scaler.health_step, "numel") == 4 * 8 + 6 * 8  # the output gradient: both backwards
    for scaler in layer.scalers():
        scaler.advance()  # the step boundary: this step's vector becomes the last step's
    assert all(s.health_step is None and s.health_last is not None for s in layer.scalers())
    set_health_measurement(layer, False)
    layer(x1).sum().backward()
    for scaler in layer.scalers():
        scaler.advance()
    assert all(s.health_last is None for s in layer.scalers())  # not measured: no stale figures


def test_forward_and_backward_add_no_host_sync(monkeypatch):
    """With health on and what-if counting, a training forward and backward never read a device value on the
    host: no item / bool / int / float / tolist / numpy / cpu (Tensor methods, patched: the backward runs
    outside Python's torch-function modes) and no op that reads one (``_local_scalar_dense``, or one that
    syncs on CUDA: nonzero, bincount on a device, masked_select, unique)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    layer = tiny_layer(quantize_grads=True)  # its recorded step syncs once (advance): not the forward's
    set_health_measurement(layer, True)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    seen: list[str] = []
    for name in ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__"):
        def recording(self, *args, _name=name, _method=getattr(torch.Tensor, name), **kwargs):
            seen.append(_name)
            return _method(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, recording)
    syncing_ops = {torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero, torch.ops.aten.bincount,
                   torch.ops.aten.masked_select, torch.ops.aten._unique2, torch.ops.aten.unique_consecutive}

    class SyncingOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            cpu_bincount = func.overloadpacket is torch.ops.aten.bincount and args[0].device.type == "cpu"
            if func.overloadpacket in syncing_ops and not cpu_bincount:  # a CPU has no device to wait for
                seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with SyncingOps():
        bool(torch.ones(1))  # the probe sees a host read
    assert seen == ["__bool__", "aten._local_scalar_dense.default"]
    seen.clear()
    with SyncingOps():
        layer(x).sum().backward()
    assert seen == []
    monkeypatch.undo()
    assert all(s.health_step is not None for s in layer.scalers())  # health measured, on all three tensors
    assert int(layer.input_scaler.step_whatif_clipped[WHATIF_ALGOS.index("most_recent")]) > 0  # what-if counted


@pytest.mark.slow
def test_fit_logs_health_and_whatif_and_summarizes_them(tmp_path, tiny_model_dir, tiny_corpus):
    """main.py fit: what-if totals every step, health on the logged steps (every 2nd), the summary's blocks."""
    import main as cli
    from tests._cli_runs import STEPS, WARMUP, write_config

    config = write_config(tmp_path, tiny_model_dir, tiny_corpus, **{"trainer.log_every_n_steps": 2})
    trainer = cli.cli_main(["fit", "--config", config]).trainer
    rows = list(csv.DictReader(open(os.path.join(trainer.logger.log_dir, "metrics.csv"))))
    by_step: dict[int, dict] = {}
    for row in rows:
        by_step.setdefault(int(row["step"]), {}).update({k: v for k, v in row.items() if v != ""})
    for step in range(STEPS):
        assert all(f"whatif/{algo}/{kind}" in by_step[step] for algo in WHATIF_ALGOS for kind in ("clipped", "events"))
    health_steps = {s for s, values in by_step.items() if "health/min_sqnr_db" in values}
    assert health_steps == {s for s in range(WARMUP, STEPS) if (s + 1) % 2 == 0}  # logged and quantized
    logged = by_step[max(health_steps)]
    tensor = next(k.split("/")[1] for k in logged if k.startswith("health/") and k.endswith("/sqnr_db"))
    for key in ("sqnr_db", "underflow_frac", "outlier_factor", *(f"tier/{t}" for t in TIERS)):
        assert f"health/{tensor}/{key}" in logged, key
    assert sum(float(logged[f"health/{tensor}/tier/{t}"]) for t in TIERS) == pytest.approx(1.0)
    assert float(logged["whatif/max/clipped"]) == float(logged["sat/clipped"])  # the run's own estimator

    summary = json.load(open(os.path.join(trainer.logger.log_dir, "saturation_summary.json")))
    assert set(summary["whatif"]) == set(WHATIF_ALGOS) and summary["whatif"]["max"]["clipped"] == summary["clipped"]
    assert summary["whatif"]["max"]["events"] == summary["saturation_events"] and summary["whatif"]["current"]["clipped"] == 0
    worst = summary["health_worst"]
    assert len(worst) == summary["quantized_tensors"] and worst == sorted(worst, key=lambda w: w["worst_sqnr_db"])
    entry = summary["tensors"][worst[0]["tensor"]]
    assert entry["health"]["worst_sqnr_db"] == worst[0]["worst_sqnr_db"] <= entry["health"]["last"]["sqnr_db"]
    assert set(entry["whatif"]) == set(WHATIF_ALGOS)

    # the what-if headroom of the last measured step: at the run's own max_val its bound holds the exact SQNR the
    # health measured on the same step, and its estimate lies within the estimator's accuracy of it
    from qat_app.hif8.headroom import ACCURACY_DB

    headroom = summary["headroom"]
    assert headroom["step"] == max(health_steps) and 15.0 in headroom["grid"] and headroom["suggested"]["all"] is not None
    run = headroom["grid"].index(15.0)
    assert set(headroom["tensors"]) == set(summary["tensors"])
    for name, estimate in headroom["tensors"].items():
        last = summary["tensors"][name]["health"]["last"]
        assert last["step"] == headroom["step"]
        low, high = estimate["sqnr_db_low"][run], estimate["sqnr_db_high"][run]
        assert low - 1e-9 <= last["sqnr_db"] <= (math.inf if high is None else high) + 1e-9, name
        assert abs(estimate["sqnr_db"][run] - last["sqnr_db"]) < ACCURACY_DB, name
    assert {"headroom/all/best_max_val", "headroom/input/best_max_val", "headroom/weight/gain_db"} <= set(logged)
    lasts = [summary["tensors"][name]["health"]["last"]["sqnr_db"] for name in headroom["tensors"]]
    assert headroom["measured"]["sqnr_db"] == pytest.approx(sum(lasts) / len(lasts))
    assert headroom["measured"]["clipped"] >= 0

    # the saturation forecast: scored at the end, its per-step risk count logged on every quantized step
    forecast = summary["forecast"]
    assert forecast["horizon"] == forecast["window"] and forecast["window"] > 0
    assert forecast["hits"] + forecast["false_alarms"] + forecast["open_at_end"] == forecast["warnings"]
    assert forecast["misses"] <= forecast["tensors_clipped"] <= summary["quantized_tensors"]
    assert all("forecast/at_risk" in by_step[s] for s in range(WARMUP, STEPS))
