"""The stacked, batched scaler update (the one implementation; AmaxScaler runs it as a bank of one) against
the readable per-scaler reference of tests/_reference_scaler.py, bit for bit."""

from __future__ import annotations

import pytest
import torch

from qat_app.hif8.scaler_bank import advance_all, banks, discard_all, seed_all
from qat_app.hif8.scaling import AmaxScaler
from tests._reference_scaler import ReferenceScaler


# (max_val, margin) per scaler: two banks (max_val 15 and 224), margins 0 and 1
SETTINGS = [(15.0 if i % 3 else 224.0, float(i % 2)) for i in range(7)]


def make(algo: str, n: int = 7, cls=AmaxScaler):
    return [cls(algo, history_len=4, alpha=0.3, max_val=SETTINGS[i][0], margin=SETTINGS[i][1]) for i in range(n)]


def feed(scalers, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    for i, scaler in enumerate(scalers):
        if (i + step) % 4 == 0:
            continue  # not seen this step
        amax = torch.rand((), generator=g) * 10
        if i == 5 and step == 6:
            amax = torch.tensor(float("nan"))
        if i == 6 and step == 5:
            amax = torch.tensor(float("inf"))
        if i == 2 and step in (0, 1):
            amax = torch.tensor(0.0)  # no valid scale yet: the scale stays 1.0
        quantized = step >= 2
        scaler.observe(amax, torch.tensor(i % 2) if quantized else None, 100)
        scaler.observe(amax * 0.5, torch.tensor(1) if quantized else None, 100)
        if i == 4 and step == 6:
            scaler.step_clipped_anywhere.fill_(1.0)  # another rank clipped (what sync_step_amax sets)


def assert_same(reference: ReferenceScaler, scaler: AmaxScaler, where) -> None:
    assert reference.uses_current_scaling == scaler.uses_current_scaling, where
    ours = scaler.state_dict() | {"step_clipped_anywhere": scaler.step_clipped_anywhere}
    for name, expected in reference.state().items():  # exact (rtol = atol = 0), NaN where NaN (last_amax)
        torch.testing.assert_close(ours[name], expected, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{where} {name}: {m}")


@pytest.mark.parametrize("algo", ["max", "most_recent", "exp_smooth", "current"])
def test_the_bank_and_each_scaler_alone_equal_the_reference(algo):
    """Unseen steps, NaN / inf / zero amax, a skipped step, seeding mid-run, clipping on another rank:
    advance_all (stacked banks), AmaxScaler.advance (a bank of one each) and the per-scaler reference
    agree bit for bit on every buffer."""
    reference, alone, batched = make(algo, cls=ReferenceScaler), make(algo), make(algo)
    for step in range(9):
        for group in (reference, alone, batched):
            feed(group, step)
        if step == 3:  # the end of the warmup
            for s in reference + alone:
                s.seed_history()
            seed_all(batched)
        if step == 4:  # a skipped step
            for s in reference + alone:
                s.discard_step()
            discard_all(batched)
        else:
            for s in reference + alone:
                s.advance()
            advance_all(batched)
        for i, (r, a, b) in enumerate(zip(reference, alone, batched)):
            assert_same(r, a, (step, i, "alone"))
            assert_same(r, b, (step, i, "batched"))
            assert a.version == b.version and a.has_history == b.has_history


def test_a_scaler_advanced_alone_leaves_its_bank_and_the_rest_stay_exact():
    """Advancing one scaler of a stacked bank on its own re-stacks it (a bank of one); the model's bank
    notices and stacks again, and every scaler still equals the reference."""
    reference, scalers = make("max", cls=ReferenceScaler), make("max")
    for step in range(5):
        feed(reference, step), feed(scalers, step)
        for s in reference:
            s.advance()
        if step % 2:
            scalers[1].advance()  # alone
            advance_all(scalers[:1] + scalers[2:])
        else:
            advance_all(scalers)
        for i, (r, s) in enumerate(zip(reference, scalers)):
            assert_same(r, s, (step, i))
    assert len(scalers[1].bank().scalers) == 1


def test_the_bank_is_views_and_is_rebuilt_after_a_move():
    scalers = make("max")
    (bank,) = [b for b in banks(scalers) if b.max_val == 15.0 and b.margin == 0.0]
    assert any(b is bank for b in banks(scalers))  # reused while intact
    members = bank.scalers
    assert members[0].scale.data_ptr() == bank.row("scale")[0].data_ptr()  # a view into the stack
    for s in members:
        s.to(torch.float32)  # a no-op move keeps the buffers
    # load_state_dict writes into the views: the bank sees it
    state = members[0].state_dict()
    state["scale"] = torch.tensor(3.0)
    members[0].load_state_dict(state)
    assert float(bank.row("scale")[0]) == 3.0
    # replacing buffers (what .to(device) does) breaks the views: the next call stacks again
    members[1]._apply(lambda t: t.clone())
    assert not bank.intact(members)
    assert all(b is not bank for b in banks(scalers))


def test_op_count_does_not_grow_with_the_number_of_scalers():
    from torch.profiler import ProfilerActivity, profile

    def ops(n: int) -> int:
        scalers = [AmaxScaler("max", history_len=16) for _ in range(n)]
        for s in scalers:
            s.observe(torch.tensor(1.0), torch.tensor(0), 10)
        advance_all(scalers)  # stacks once
        for s in scalers:
            s.observe(torch.tensor(2.0), torch.tensor(1), 10)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            advance_all(scalers)
        return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)

    small, large = ops(8), ops(512)
    assert small == large < 128  # a constant (views and indexing included; ~110 with the what-if state), not ~46 per scaler
