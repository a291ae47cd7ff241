"""Each a_hat algorithm against a hand-computed history (AmaxScaler and the reference of tests/_reference_scaler.py);
degenerate amax never breaks the scale."""

import math

import pytest
import torch

from qat_app.hif8.scaler_bank import ScalerBank, advance_all, sync_step_amax
from qat_app.hif8.scaling import AmaxScaler
from tests._reference_scaler import ReferenceScaler

STEP_AMAX = [2.0, 5.0, 3.0, 1.0, 4.0]


def run_steps(scaler: AmaxScaler, amaxes, micro_batches=1):
    a_hats, scales = [], []
    for amax in amaxes:
        for k in range(micro_batches):
            # the step's amax is reached by one micro-batch only; the rest are smaller
            scaler.observe(torch.tensor(amax if k == micro_batches - 1 else amax / 3), None, 10)
        scaler.advance()
        a_hats.append(scaler.a_hat.item())
        scales.append(scaler.scale.item())
    return a_hats, scales


@pytest.mark.parametrize(
    "algo,kwargs,expected",
    [
        ("most_recent", {}, [2.0, 5.0, 3.0, 1.0, 4.0]),
        ("max", {"history_len": 3}, [2.0, 5.0, 5.0, 5.0, 4.0]),  # window of 3 steps
        ("exp_smooth", {"alpha": 0.5}, [2.0, 3.5, 3.25, 2.125, 3.0625]),
        ("current", {}, [2.0, 5.0, 3.0, 1.0, 4.0]),
    ],
)
@pytest.mark.parametrize("micro_batches", [1, 4])
@pytest.mark.parametrize("cls", [AmaxScaler, ReferenceScaler])
def test_a_hat_follows_the_papers_equations(algo, kwargs, expected, micro_batches, cls):
    scaler = cls(algo=algo, max_val=15.0, **{"history_len": 8, **kwargs})
    a_hats, scales = run_steps(scaler, STEP_AMAX, micro_batches)
    assert a_hats == pytest.approx(expected)
    assert scales == pytest.approx([15.0 / a for a in expected])
    assert scaler.amax_history[: min(5, scaler.history_len)].tolist() == list(reversed(STEP_AMAX))[: scaler.history_len]


def test_one_scaler_is_advanced_by_the_banks_code_as_a_bank_of_one():
    scaler = AmaxScaler(algo="max", history_len=4)
    run_steps(scaler, [3.0])
    bank = scaler.bank()
    assert isinstance(bank, ScalerBank) and bank.scalers == [scaler]
    assert scaler.scale.data_ptr() == bank.row("scale")[0].data_ptr()  # its buffers are the bank's rows
    run_steps(scaler, [4.0]), scaler.seed_history(), scaler.discard_step()
    assert scaler.bank() is bank  # reused while intact
    scaler._apply(lambda t: t.clone())  # what .to(device) does: the next update stacks again
    run_steps(scaler, [5.0])
    assert scaler.bank() is not bank and scaler.amax_history.tolist() == [5.0, 4.0, 3.0, 4.0]  # seeded slot


def test_margin_divides_the_scale():
    scaler = AmaxScaler(algo="most_recent", max_val=15.0, margin=1.0)
    run_steps(scaler, [3.0])
    assert scaler.scale.item() == pytest.approx(15.0 / 3.0 / 2.0)


@pytest.mark.parametrize("bad", [0.0, math.nan, math.inf])
def test_degenerate_amax_keeps_previous_scale_and_history(bad):
    scaler = AmaxScaler(algo="max", history_len=4, max_val=15.0)
    run_steps(scaler, [3.0])
    history = scaler.amax_history.clone()
    run_steps(scaler, [bad])
    assert math.isfinite(scaler.scale.item()) and scaler.scale.item() == pytest.approx(5.0)
    if bad != 0.0:  # NaN / inf never enter the history
        assert torch.equal(scaler.amax_history, history)
        assert scaler.steps_recorded.item() == 1


def test_first_ever_zero_amax_gives_scale_one():
    scaler = AmaxScaler(algo="most_recent")
    run_steps(scaler, [0.0])
    assert scaler.scale.item() == 1.0


def test_unseen_step_does_not_advance_the_history():
    scaler = AmaxScaler(algo="max", history_len=4)
    run_steps(scaler, [3.0])
    scaler.advance()  # nothing observed this step
    assert scaler.steps_recorded.item() == 1
    assert scaler.amax_history.tolist() == [3.0, 0.0, 0.0, 0.0]


def test_saturation_counters_accumulate_per_step_and_in_total():
    scaler = AmaxScaler()
    scaler.observe(torch.tensor(1.0), torch.tensor(3), 100)
    scaler.observe(torch.tensor(1.0), torch.tensor(2), 100)
    scaler.advance()
    scaler.observe(torch.tensor(1.0), torch.tensor(0), 100)
    scaler.advance()
    assert scaler.last_clipped.item() == 0 and scaler.last_numel.item() == 100
    assert scaler.total_clipped.item() == 5 and scaler.total_numel.item() == 300
    assert scaler.saturation_events.item() == 1


def test_seed_history_fills_the_window_from_warmup():
    scaler = AmaxScaler(algo="max", history_len=4)
    run_steps(scaler, [1.0, 3.0])
    scaler.seed_history()
    assert scaler.amax_history.tolist() == [3.0, 1.0, 3.0, 3.0]
    assert scaler.a_hat.item() == 3.0 and scaler.scale.item() == pytest.approx(5.0)


def test_current_scaling_until_history_exists():
    scaler = AmaxScaler(algo="max")
    assert scaler.uses_current_scaling
    run_steps(scaler, [1.0])
    assert not scaler.uses_current_scaling
    assert AmaxScaler(algo="current").uses_current_scaling


def test_state_dict_round_trip_restores_everything():
    scaler = AmaxScaler(algo="exp_smooth", history_len=5)
    run_steps(scaler, STEP_AMAX)
    fresh = AmaxScaler(algo="exp_smooth", history_len=5)
    assert fresh.uses_current_scaling
    fresh.load_state_dict(scaler.state_dict())
    assert not fresh.uses_current_scaling
    for name, buf in scaler.named_buffers():
        assert torch.equal(buf, dict(fresh.named_buffers())[name]), name
    run_steps(scaler, [7.0]), run_steps(fresh, [7.0])
    assert scaler.a_hat.item() == fresh.a_hat.item()


def test_sync_and_advance_all_on_one_process():
    scalers = [AmaxScaler(algo="most_recent") for _ in range(3)]
    for i, s in enumerate(scalers):
        s.observe(torch.tensor(float(i + 1)), None, 1)
    sync_step_amax(scalers)  # no process group: a no-op
    advance_all(scalers)
    assert [s.a_hat.item() for s in scalers] == [1.0, 2.0, 3.0]


def test_unknown_algorithm_is_refused():
    with pytest.raises(ValueError, match="amax_algo"):
        AmaxScaler(algo="median")
