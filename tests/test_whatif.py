"""What-if clipping: every quantized tensor also counts what the other amax estimators would have clipped on it.

The counts must equal an independent count: a_hat of each estimator worked out by hand from a hand-built amax
history, its scale by ``compute_scale``, its clipped elements by ``fake_quant.saturated_mask`` -- in the plain,
compiled and (interpreted) Triton paths; the scaler's own estimator must count exactly what the real counter
counts. The state behind them (exp_smooth's estimate, the delayed scales, the totals) follows every scaler's
own update, resumes from a checkpoint exactly, and older checkpoints still load. A 2-process gloo run reports
the same what-if and health figures as one process on the same global batch.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qat_app.config import QuantConfig
from qat_app.hif8.fake_quant import compute_scale, saturated_mask
from qat_app.hif8.health import DELAYED_ALGOS, WHATIF_ALGOS
from qat_app.hif8.linear import HiF8Linear
from qat_app.hif8.recipe import AMAX_ALGOS
from qat_app.hif8.scaler_bank import advance_all, seed_all
from qat_app.hif8.scaling import AmaxScaler
from qat_app.hif8.operand import Operand

HISTORY, ALPHA = 3, 0.5
# recorded amax per step, oldest first: 4 steps into a window of 3, so max forgets the first (all exact in float32)
INPUT_AMAXES = (5.0, 4.0, 1.0, 2.0)
WEIGHT_AMAXES = (0.5, 0.2, 0.05, 0.1)


def hand_estimates(amaxes) -> dict[str, float]:
    """a_hat of each delayed estimator after these recorded steps (the paper's equations, by hand)."""
    smoothed = amaxes[0]  # a_hat(1) = amax(0)
    for amax in amaxes[1:]:
        smoothed = ALPHA * amax + (1 - ALPHA) * smoothed
    return {"most_recent": amaxes[-1], "exp_smooth": smoothed, "max": max(amaxes[-HISTORY:])}


def independent_counts(x: torch.Tensor, amaxes, max_val: float = 15.0, fmt: str = "hif8") -> list[int]:
    """Clipped elements of ``x`` under each estimator: the real counter's definition (saturated_mask) at the
    scale each a_hat gives; current scaling with the tensor's own amax."""
    x = x.detach()
    a_hats = hand_estimates(amaxes) | {"current": float(x.float().abs().max())}
    counts = []
    for algo in WHATIF_ALGOS:
        scale = compute_scale(torch.tensor(a_hats[algo]), max_val, 0.0, torch.tensor(1.0))
        counts.append(int(saturated_mask(x, scale, max_val, fmt).sum()))
    return counts


def record(scaler: AmaxScaler, amaxes) -> None:
    """A hand-built history: one recorded (unquantized) step per amax."""
    for amax in amaxes:
        scaler.observe(torch.tensor(amax), None, 1)
        scaler.advance()


def paths():
    out = [pytest.param("off", False, id="plain"), pytest.param("on", False, id="compiled")]
    try:
        import triton  # noqa: F401

        out.append(pytest.param("on", True, id="triton-interpreted"))
    except Exception:
        pass
    return out


def use_triton_on_cpu(monkeypatch) -> None:
    """The layer's fake quantization through the Triton kernel under the interpreter (CPU tensors)."""
    from qat_app.hif8 import fake_quant
    from qat_app.hif8.backends.compiled import CompiledBackend
    from qat_app.hif8.backends.triton import TritonBackend

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    backend = TritonBackend(CompiledBackend(required=True), required=True)
    monkeypatch.setattr(fake_quant, "resolve", lambda mode, device_type, fmt_name: backend)


def spread_input(seed: int = 0) -> torch.Tensor:
    """Activations up to ~5.5: each estimator's scale clips a different number of them."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(12, 16, generator=g) * 1.6


@pytest.mark.parametrize("fused,triton", paths())
@pytest.mark.parametrize("algo", AMAX_ALGOS)
def test_whatif_counts_equal_an_independent_count(algo, fused, triton, monkeypatch):
    if triton:
        use_triton_on_cpu(monkeypatch)
    layer = HiF8Linear(16, 8, bias=False, **QuantConfig(amax_algo=algo, history_len=HISTORY, alpha=ALPHA,
                                                        fused=fused).layer_options())
    with torch.no_grad():
        layer.weight.uniform_(-0.25, 0.25, generator=torch.Generator().manual_seed(1))
    record(layer.input_scaler, INPUT_AMAXES)
    record(layer.weight_scaler, WEIGHT_AMAXES)
    x = spread_input()
    layer(x)
    for scaler, tensor, amaxes in ((layer.input_scaler, x, INPUT_AMAXES), (layer.weight_scaler, layer.weight, WEIGHT_AMAXES)):
        expected = independent_counts(tensor, amaxes)
        assert scaler.step_whatif_clipped.tolist() == expected
        assert expected[WHATIF_ALGOS.index(algo)] == int(scaler.step_clipped)  # the own estimator: the real count
    counts = independent_counts(x, INPUT_AMAXES)
    assert len(set(counts[:3])) == 3 and counts[3] == 0  # the delayed ones differ; CTS clips no finite tensor


def test_current_entry_uses_the_fallback_a_cts_scaler_would_use():
    """A tensor holding inf: current scaling falls back to the scale of the most recent amax (a CTS scaler's own
    scale); its what-if equals the real CTS count, the inf and the finite elements that scale clips."""
    layer = HiF8Linear(4, 2, bias=False, **QuantConfig(amax_algo="current", history_len=HISTORY, fused="off").layer_options())
    record(layer.input_scaler, (8.0, 2.0))
    x = torch.tensor([[1.0, 2.5, float("inf"), -3.0]])
    layer(x)
    scaler = layer.input_scaler
    fallback = compute_scale(torch.tensor(2.0), 15.0, 0.0, torch.tensor(1.0))
    assert int(scaler.step_clipped) == int(saturated_mask(x, fallback, 15.0, "hif8").sum()) == 3
    assert scaler.step_whatif_clipped[WHATIF_ALGOS.index("current")].item() == 3


@pytest.mark.parametrize("fused,triton", paths())
@pytest.mark.parametrize("special", ["inf", "nan", "zeros", "tiny"])
def test_counts_made_in_the_quantize_pass_equal_a_pass_of_their_own(special, fused, triton, monkeypatch):
    """A delayed scaler counts the what-if while it quantizes (current scaling's entry by the rule of
    ``health.current_never_clips``): on tensors where current scaling has no usable scale (an inf, a NaN, all
    zeros, an amax whose scale overflows) the counts equal the separate pass's (``health.whatif_clipped``)."""
    from qat_app.hif8.health import current_never_clips, whatif_clipped

    if triton:
        use_triton_on_cpu(monkeypatch)
    scaler = AmaxScaler("max", HISTORY, ALPHA, 15.0)
    record(scaler, INPUT_AMAXES)
    x = {"inf": spread_input().flatten().index_fill(0, torch.tensor([3]), float("inf")),
         "nan": spread_input().flatten().index_fill(0, torch.tensor([5]), float("nan")),
         "zeros": torch.zeros(64), "tiny": torch.full((64,), 1e-39)}[special]
    result, _ = scaler.quantize(x, "hif8", fused=fused, whatif=True)
    assert result.whatif is not None  # counted in the pass
    in_pass, _ = scaler.measure(x, result, scaler.scale, "hif8", fused=fused)
    separate = whatif_clipped(x, scaler.whatif_scale, result.amax, 15.0, 0.0, 15.5, fused=fused)
    assert in_pass.tolist() == separate.tolist()
    most_recent = separate[WHATIF_ALGOS.index("most_recent")]
    assert separate[WHATIF_ALGOS.index("current")] == most_recent  # the fallback scale's count
    assert (int(most_recent) > 0) == (special in ("inf", "nan"))  # the spread input clips; zeros and 1e-39 do not
    assert current_never_clips(15.0, 0.0, 15.5) and not current_never_clips(15.0, -1.0, 15.5)
    assert not current_never_clips(15.0, 0.0, 15.0 * (1 + 2.0**-22))  # a threshold at max_val: a pass of its own


def test_a_threshold_the_rule_cannot_clear_counts_in_a_pass_of_its_own():
    """max_val one float32 ulp below a rounding midpoint: the threshold is then within an ulp of max_val, current
    scaling may clip, and the scaler counts its what-if with a separate pass (the count still exact)."""
    import numpy as np

    from qat_app.hif8.formats import saturation_threshold

    max_val = float(np.nextafter(np.float32(15.5), np.float32(0)))
    threshold = saturation_threshold("hif8", max_val)
    scaler = AmaxScaler("max", HISTORY, ALPHA, max_val)
    record(scaler, INPUT_AMAXES)
    x = spread_input()
    result, scale = scaler.quantize(x, "hif8", whatif=True)
    assert result.whatif is None and threshold < max_val * (1 + 2.0**-20)  # the rule does not apply here
    whatif, _ = scaler.measure(x, result, scale, "hif8")
    current = compute_scale(x.abs().max(), max_val, 0.0, torch.tensor(1.0))
    assert int(whatif[WHATIF_ALGOS.index("current")]) == int((x.abs() * current >= threshold).sum())


def test_nothing_is_counted_before_a_history_or_while_not_quantized():
    layer = HiF8Linear(16, 8, bias=False, **QuantConfig(amax_algo="max", history_len=HISTORY, fused="off").layer_options())
    x = spread_input() * 10
    layer(x)  # no recorded step: current scaling, no what-if
    assert int(layer.input_scaler.step_numel) > 0 and layer.input_scaler.step_whatif_clipped.tolist() == [0] * 4
    layer.input_scaler.advance()
    layer.switch(Operand.INPUT, False)  # the warmup: observed, not quantized
    layer(x)
    assert int(layer.input_scaler.step_numel) == 0 and layer.input_scaler.step_whatif_clipped.tolist() == [0] * 4


def feed(scalers, step: int) -> None:
    """The same amax to every scaler: unseen, NaN, inf and zero steps included."""
    amax = torch.rand((), generator=torch.Generator().manual_seed(step)) * 10
    if step in (2, 6):
        return  # not seen
    amax = {4: torch.tensor(float("nan")), 5: torch.tensor(float("inf")), 0: torch.tensor(0.0)}.get(step, amax)
    for s in scalers:
        s.observe(amax, None, 1)


@pytest.mark.parametrize("margin", [0.0, 1.0])
def test_whatif_state_is_what_each_estimator_holds(margin):
    """smoothed_a_hat of every scaler is exp_smooth's a_hat, and whatif_scale[k] the scale of a scaler running
    DELAYED_ALGOS[k], bit for bit, through unseen / NaN / inf / zero steps, seeding, batched and alone."""
    make = lambda algo: AmaxScaler(algo, history_len=4, alpha=0.3, margin=margin)  # noqa: E731
    runners = {algo: make(algo) for algo in AMAX_ALGOS}
    batched = [make(algo) for algo in AMAX_ALGOS]
    for step in range(10):
        feed(list(runners.values()) + batched, step)
        if step == 3:
            for s in runners.values():
                s.seed_history()
            seed_all(batched)
        else:
            for s in runners.values():
                s.advance()
            advance_all(batched)
        for scaler in list(runners.values()) + batched:
            assert torch.equal(scaler.smoothed_a_hat, runners["exp_smooth"].a_hat), step
            for k, algo in enumerate(DELAYED_ALGOS):
                assert torch.equal(scaler.whatif_scale[k], runners[algo].scale), (step, algo)


def test_totals_events_and_an_exact_resume():
    """Run totals and events add up the per-step counts; a layer resumed from a mid-run state dict continues
    with the same what-if counts as the uninterrupted one."""
    options = QuantConfig(amax_algo="most_recent", history_len=HISTORY, alpha=ALPHA, fused="off").layer_options()
    torch.manual_seed(0)
    straight = HiF8Linear(16, 8, bias=False, **options)
    resumed = None
    per_step = []
    for step in range(6):
        for layer in [straight] + ([resumed] if resumed is not None else []):
            layer(spread_input(step) * (1.0 + step % 3))  # amax moves: the estimators disagree
            layer.input_scaler.advance(), layer.weight_scaler.advance()
        per_step.append(straight.input_scaler.last_whatif_clipped.clone())
        if step == 2:
            torch.manual_seed(1)
            resumed = HiF8Linear(16, 8, bias=False, **options)
            resumed.load_state_dict(straight.state_dict())
    scaler = straight.input_scaler
    steps = torch.stack(per_step)
    assert torch.equal(scaler.total_whatif_clipped, steps.sum(0))
    assert torch.equal(scaler.whatif_events, (steps > 0).sum(0))
    assert (steps.sum(0)[:3] > 0).all()  # not vacuous
    for name, value in straight.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(resumed.state_dict()[name], value), name


@pytest.mark.parametrize("algo", AMAX_ALGOS)
def test_state_dict_without_the_whatif_state_still_loads(algo):
    scaler = AmaxScaler(algo, history_len=HISTORY, alpha=ALPHA)
    record(scaler, INPUT_AMAXES)
    new = ("smoothed_a_hat", "whatif_scale", "step_whatif_clipped", "last_whatif_clipped", "total_whatif_clipped",
           "whatif_events")
    old = {k: v for k, v in scaler.state_dict().items() if k not in new}
    restored = AmaxScaler(algo, history_len=HISTORY, alpha=ALPHA)
    restored.load_state_dict(old)  # strict: a checkpoint of the previous layout
    assert restored.total_whatif_clipped.tolist() == [0] * 4
    if algo in DELAYED_ALGOS:  # the own estimator's what-if scale is the checkpoint's scale
        assert torch.equal(restored.whatif_scale[DELAYED_ALGOS.index(algo)], restored.scale)
    expected_smoothed = hand_estimates(INPUT_AMAXES)["exp_smooth"] if algo == "exp_smooth" else INPUT_AMAXES[-1]
    assert float(restored.smoothed_a_hat) == expected_smoothed


# ------------------------------------------------------------------------------ data parallel: 2 processes
def dp_model(seed: int = 0):
    """A quantized layer (input, weight, stochastically rounded output gradient) with a hand-built history."""
    from torch import nn

    torch.manual_seed(seed)
    options = QuantConfig(amax_algo="max", history_len=HISTORY, alpha=ALPHA, quantize_grads=True,
                          fused="off").layer_options()
    layer = HiF8Linear(16, 8, bias=False, **options)
    for scaler, amaxes in zip(layer.scalers(), (INPUT_AMAXES, WEIGHT_AMAXES, (6.0, 4.0, 3.0, 5.0))):
        record(scaler, amaxes)
    model = nn.Sequential()
    model.add_module("model", nn.Sequential())
    model.model.add_module("proj", layer)
    return model


def dp_batch(step: int) -> torch.Tensor:
    x = spread_input(10 + step)
    x[3, :4] = torch.tensor([1e-9, -1e-8, 0.0, 7.0])  # underflow, a zero, an outlier
    return x


def dp_steps(model, world: int, rank: int, steps: int = 2):
    """``steps`` optimizer steps of the global batch (this rank's share), health measured on the last; ->
    the saturation callback's gathered figures per step (counts summed over the ranks) and its run totals."""
    from qat_app.hif8.step_record import FIELDS, WHATIF_COUNT, named_scalers
    from qat_app.hif8.counters import HEALTH, gather_columns
    from qat_app.hif8.quantized import set_health_measurement
    from qat_app.hif8.scaler_bank import sync_step_amax

    trained = model
    if world > 1:
        from qat_app.hif8.scaling import keep_scalers_out_of_ddp_broadcast

        keep_scalers_out_of_ddp_broadcast(model)
        trained = torch.nn.parallel.DistributedDataParallel(model)
    figures = []
    for step in range(steps):
        set_health_measurement(model, step == steps - 1)
        torch.manual_seed(100 + rank)  # stochastic rounding: each rank draws its own bits
        out = trained(dp_batch(step).chunk(world)[rank])
        out.square().sum().backward()  # the output gradient 2 * out: each rank's rows, as one process has them
        scalers = [s for _, s in named_scalers(model)]
        sync_step_amax(scalers)
        advance_all(scalers)
        fields = (WHATIF_COUNT,) + ((HEALTH,) if step == steps - 1 else ())
        figures.append(gather_columns(named_scalers(model), FIELDS, fields))
    totals = gather_columns(named_scalers(model), ("whatif_events",), ("total_whatif_clipped", "total_clipped"))
    return figures, totals


def dp_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        figures, totals = dp_steps(dp_model(), world, rank)
        torch.save({"figures": figures, "totals": totals}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_processes_report_what_one_process_reports(tmp_path):
    """DDP on 2 gloo processes, each with half of one global batch, against one process on all of it: the same
    what-if counts, events and totals, and the same health (counts exact, SQNR sums to float64 rounding).
    The gradient's stochastic rounding draws other bits per rank, so its health is compared where it must agree
    (elements counted once)."""
    from qat_app.hif8.health import FIELDS, HEALTH_LEN, HIST_OFFSET, summarize

    mp.spawn(dp_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    single, totals = dp_steps(dp_model(), 1, 0)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for want_step, got_step in zip(single, got["figures"]):
            assert torch.equal(got_step["last_whatif_clipped"], want_step["last_whatif_clipped"])
        for key, value in totals.items():
            assert torch.equal(got["totals"][key], value), key
        want, have = single[-1]["health_last"], got["figures"][-1]["health_last"]
        assert have.shape == (3, HEALTH_LEN)
        counts = [FIELDS.index("numel"), FIELDS.index("underflow"), *range(len(FIELDS), HEALTH_LEN)]
        # input and weight: identical quantization on both sides
        assert torch.equal(have[:2, counts], want[:2, counts])
        torch.testing.assert_close(have[:2, 1:3], want[:2, 1:3], rtol=1e-12, atol=0)
        assert torch.equal(have[2, :1], want[2, :1]) and torch.equal(have[2, HIST_OFFSET:], want[2, HIST_OFFSET:])
        ours, theirs = summarize(have[:2], got["figures"][-1]["last_amax"][:2]), summarize(want[:2], single[-1]["last_amax"][:2])
        for key in ours:
            torch.testing.assert_close(ours[key], theirs[key], rtol=1e-9, atol=0, equal_nan=True, msg=key)
    clipped = totals["total_whatif_clipped"]
    assert (clipped[:2, :3] > 0).all() and int(single[-1]["health_last"][0, FIELDS.index("underflow")]) >= 2
    assert torch.isfinite(summarize(single[-1]["health_last"][:2], single[-1]["last_amax"][:2])["sqnr_db"]).all()
