"""What-if headroom (qat_app.hif8.headroom): against exact recomputation, its bound, its digest, its bad input."""

from __future__ import annotations

import math

import pytest
import torch

from qat_app.hif8.errors import FieldError
from qat_app.hif8.fake_quant import fake_quantize
from qat_app.hif8.formats import get_format
from qat_app.hif8.headroom import ACCURACY_DB, DEFAULT_GRID, PAYS_DB, digest, estimate_headroom, validate_grid
from qat_app.hif8.health import measure_health

HIF8 = get_format("hif8")


def exact(x: torch.Tensor, a_hat: torch.Tensor, max_val: float) -> tuple[float, int]:
    """SQNR (dB) and clipped elements of x fake-quantized at max_val with the scale max_val / a_hat: the reference."""
    result = fake_quantize(x, (max_val / a_hat).float(), max_val)
    error = ((x.double() - result.dequantized.double()) ** 2).sum()
    sqnr = 10 * math.log10(float((x.double() ** 2).sum() / error)) if error > 0 else math.inf
    return sqnr, int(result.clipped)


def tensors():
    gen = torch.Generator().manual_seed(0)
    return {
        "gaussian": torch.randn(1 << 18, generator=gen),
        "student_t3": torch.distributions.StudentT(3.0).sample((1 << 18,)),
        "small_tensor": torch.randn(4096, generator=gen) * 1e-3,
        "sparse_outliers": torch.where(torch.rand(1 << 16, generator=gen) < 1e-3, 50.0, 1.0)
        * torch.randn(1 << 16, generator=gen),
    }


@pytest.mark.parametrize("name", list(tensors()))
@pytest.mark.parametrize("under", [1.0, 0.7])  # a_hat = amax, or 30 % under it (the estimate too small: clipping)
def test_estimate_lies_within_its_bound_and_near_the_exact_recomputation(name, under):
    torch.manual_seed(1)
    x = tensors()[name]
    amax = x.abs().max()
    a_hat = amax * under
    health = measure_health(x, 15.0 / a_hat, 15.0, HIF8)  # measured at the paper's max_val
    estimate = estimate_headroom(health[None], a_hat.reshape(1), amax.reshape(1), DEFAULT_GRID)
    for j, max_val in enumerate(DEFAULT_GRID):
        sqnr, clipped = exact(x, a_hat, max_val)
        assert float(estimate.sqnr_db_low[0, j]) - 1e-9 <= sqnr <= float(estimate.sqnr_db_high[0, j]) + 1e-9, max_val
        assert float(estimate.clipped_low[0, j]) <= clipped <= float(estimate.clipped_high[0, j]), max_val
        assert abs(float(estimate.sqnr_db[0, j]) - sqnr) < ACCURACY_DB, (max_val, float(estimate.sqnr_db[0, j]), sqnr)
        assert abs(float(estimate.clipped[0, j]) - clipped) <= max(2.0, 0.25 * clipped), max_val


def test_the_bound_is_met_by_the_worst_placement_within_a_bin():
    """Elements on HiF8 rounding midpoints (the largest error any point can have): the estimate, which assumes them
    spread over their bins, is too optimistic, and the bound is what still holds."""
    grid = HIF8.decode(torch.arange(0x08, 0x30, dtype=torch.int32).to(torch.uint8)).double()  # 1 .. 15, mant3 tiers
    grid = torch.unique(grid[torch.isfinite(grid) & (grid > 0)])
    midpoints = ((grid[:-1] + grid[1:]) / 2).float()
    midpoints = midpoints[midpoints < 15]
    x = midpoints.repeat(64) * (1 - 2.0**-20)  # just under: rounds down, error ~ half a quantum
    a_hat = torch.tensor(15.0)  # scale 1: the grid itself
    health = measure_health(x, 15.0 / a_hat, 15.0, HIF8)
    estimate = estimate_headroom(health[None], a_hat.reshape(1), x.abs().max().reshape(1), (15.0,))
    sqnr, _ = exact(x, a_hat, 15.0)
    assert float(estimate.sqnr_db_low[0, 0]) <= sqnr + 1e-9
    assert sqnr < float(estimate.sqnr_db[0, 0]) - 1.0  # the estimate's assumption is violated here, on purpose


def test_an_error_free_tensor_and_a_tensor_of_zeros():
    x = torch.tensor([1.0, 2.0, 0.5, 0.0] * 100)  # on the grid at scale 1
    estimate = estimate_headroom(measure_health(x, torch.tensor(1.0), 15.0, HIF8)[None], torch.tensor([15.0]),
                                 torch.tensor([2.0]), (15.0,))
    assert math.isinf(float(estimate.sqnr_db_high[0, 0]))
    zeros = torch.zeros(64)
    estimate = estimate_headroom(measure_health(zeros, torch.tensor(1.0), 15.0, HIF8)[None], torch.tensor([1.0]),
                                 torch.tensor([0.0]), (15.0,))
    assert math.isnan(float(estimate.sqnr_db[0, 0])) and float(estimate.clipped_high[0, 0]) == 0


@pytest.mark.parametrize("grid", [[], [0.0], [-4.0], [math.inf], [40960.0], [15.0, 1e-9]])
def test_a_grid_the_format_cannot_hold_names_the_field(grid):
    with pytest.raises(FieldError, match="headroom_grid"):
        validate_grid(grid, "hif8")
    assert validate_grid([16, 2, 15.0, 2]) == (2.0, 15.0, 16.0)


def test_digest_suggests_per_operand_only_where_it_pays_and_never_more_clipping():
    data = tensors()
    names = ["layers.3.mlp.up_proj.input", "layers.3.mlp.up_proj.weight", "layers.4.mlp.up_proj.weight"]
    gen = torch.Generator().manual_seed(2)
    # one outlier 200 sigma out: at max_val 15 the bulk (most of the power) sits in HiF8's 2-bit band, a larger
    # max_val lifts it into the 3-bit band
    outlier = torch.randn(1 << 18, generator=gen)
    outlier[0] = 200.0
    xs = [outlier, data["gaussian"], data["gaussian"] * 0.02]
    amax = torch.stack([x.abs().max() for x in xs])
    health = torch.stack([measure_health(x, 15.0 / m, 15.0, HIF8) for x, m in zip(xs, amax)])
    grid = validate_grid(DEFAULT_GRID)
    estimate = estimate_headroom(health, amax, amax, grid)
    out = digest(names, [n.rsplit(".", 1)[1] for n in names], estimate, {"input": 15.0, "weight": 15.0})
    assert out["grid"] == list(grid) and set(out["by_operand"]) == {"input", "weight"} and set(out["by_block"]) == {"3", "4"}
    run = grid.index(15.0)
    for operand, entry in out["by_operand"].items():
        best = grid.index(entry["suggested"])
        assert entry["clipped_high"][best] <= entry["clipped_high"][run]  # no more clipping than the run had
        assert entry["sqnr_db"][best] == max(v for v, c in zip(entry["sqnr_db"], entry["clipped_high"])
                                             if c <= entry["clipped_high"][run])
        assert entry["gain_db"] == pytest.approx(entry["sqnr_db"][best] - entry["sqnr_db"][run])
    # the outlier-ridden input gains from a larger max_val (its bulk moves up the taper), beyond the estimate's
    # accuracy; the Gaussian weights gain nothing that the estimate could tell from its own error
    assert out["by_operand"]["input"]["suggested"] > 15.0 and out["by_operand"]["input"]["gain_db"] > PAYS_DB
    assert out["by_operand"]["input"]["significant"]
    assert out["by_operand"]["weight"]["gain_db"] < ACCURACY_DB and not out["by_operand"]["weight"]["significant"]
    if out["suggested"]["all"] != out["by_operand"]["input"]["suggested"]:
        assert "input" in out["suggested"]
    assert set(out["tensors"]) == set(names)


def test_the_callback_names_its_bad_settings():
    from transformers import LlamaConfig, LlamaForCausalLM

    from callbacks.health_log import headroom_setup
    from callbacks.saturation import AmaxSaturationCallback
    from qat_app.config import QuantConfig, quantize_model
    from qat_app.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^saturation\.headroom needs the health measurement"):
        AmaxSaturationCallback(health=False, headroom=True)
    assert AmaxSaturationCallback(health=False).headroom is False and AmaxSaturationCallback().headroom is True
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, vocab_size=64))
    assert headroom_setup(model, None) is None  # nothing quantized: nothing to estimate
    quantize_model(model, QuantConfig(high_precision_layers=0))
    grid, run_max_val, fmt_name, margin, power_2, _ = headroom_setup(model, [4, 64])
    assert grid == (4.0, 15.0, 64.0) and run_max_val == {"input": 15.0, "weight": 15.0} and fmt_name == "hif8"
    with pytest.raises(ConfigError, match=r"^saturation\.headroom_grid: 40960 is outside what hif8 can hold"):
        headroom_setup(model, [15, 40960])
    assert headroom_setup(model, None)[0][-1] == 32768.0
    e4m3 = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, vocab_size=64))
    quantize_model(e4m3, QuantConfig(high_precision_layers=0, format="e4m3"))
    grid, run_max_val, fmt_name, *_ = headroom_setup(e4m3, None)  # the default grid, cut at E4M3's 448
    assert fmt_name == "e4m3" and grid[-1] == 448.0 and 256.0 in grid and run_max_val["input"] == 448.0


def test_the_report_renders_each_runs_headroom_or_says_it_was_not_recorded():
    from qat_app.report.health import NOT_RECORDED, render_headroom

    x = tensors()["gaussian"]
    amax = x.abs().max().reshape(1)
    grid = validate_grid(DEFAULT_GRID)
    estimate = estimate_headroom(measure_health(x, 15.0 / amax[0], 15.0, HIF8)[None], amax, amax, grid)
    entry = {"step": 7, **digest(["layers.2.mlp.down_proj.input"], ["input"], estimate, {"input": 15.0})}
    lines = render_headroom([{"label": "qat", "saturation": {"headroom": entry}}, {"label": "old", "saturation": {}}])
    header = next(i for i, line in enumerate(lines) if line.startswith("### `qat` (step 7)"))
    assert f"suggested max_val {entry['suggested']['all']:g}" in lines[header]
    row = lines[header + 4]
    assert row.startswith("| input (run: 15) | ") and row.count("|") == len(grid) + 4
    assert f"{entry['by_operand']['input']['sqnr_db'][grid.index(15.0)]:.2f}" in row
    block_row = next(line for line in lines if line.startswith("| 2 | "))  # the per-block table
    assert f"{entry['by_block']['2']['sqnr_db'][grid.index(15.0)]:.2f}" in block_row
    assert not any("`old`" in line for line in lines)
    assert NOT_RECORDED in render_headroom([{"label": "old", "saturation": None}])[-1]


def test_the_report_sets_each_runs_estimate_against_the_runs_made_at_other_max_val_settings():
    """Two 'runs' of the same tensor at max_val 15 and 4: each one's estimate at the other's max_val holds what the
    other measured (here the tensors are the same, so the bound is exact) and the table says so."""
    from qat_app.report.health import headroom_crosscheck, render_headroom

    torch.manual_seed(3)  # the Student-t sample draws from the global generator
    x = tensors()["student_t3"]
    amax = x.abs().max().reshape(1)
    grid = validate_grid(DEFAULT_GRID)
    runs = []
    for label, max_val in (("mv15", 15.0), ("mv4", 4.0)):
        health = measure_health(x, max_val / amax[0], max_val, HIF8)
        entry = {"step": 5, **digest(["layers.1.mlp.up_proj.input"], ["input"], estimate_headroom(health[None], amax, amax, grid),
                                     {"input": max_val})}
        sqnr, clipped = exact(x, amax[0], max_val)
        entry["measured"] = {"sqnr_db": sqnr, "clipped": clipped}
        runs.append((label, entry))
    rows = headroom_crosscheck(runs)
    assert [(r["predictor"], r["run"], r["max_val"]) for r in rows] == [("mv15", "mv4", 4.0), ("mv4", "mv15", 15.0)]
    for r in rows:
        assert r["sqnr_db_low"] <= r["measured_sqnr_db"] <= r["sqnr_db_high"]
        assert abs(r["sqnr_db"] - r["measured_sqnr_db"]) < ACCURACY_DB
        assert r["clipped_low"] <= r["measured_clipped"] <= r["clipped_high"]
    lines = render_headroom([{"label": label, "saturation": {"headroom": entry}} for label, entry in runs])
    assert any(line.startswith("| `mv15` | `mv4` | 4 | ") for line in lines)
