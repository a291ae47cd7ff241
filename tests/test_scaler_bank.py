"""The stacked, batched scaler update is bit-identical to advancing each scaler on its own."""

from __future__ import annotations

import pytest
import torch

from qat_app.hif8.scaler_bank import advance_all, banks, discard_all, seed_all
from qat_app.hif8.scaling import AmaxScaler


def make(algo: str, n: int = 7):
    return [AmaxScaler(algo, history_len=4, alpha=0.3, max_val=15.0 if i % 3 else 224.0) for i in range(n)]


def feed(scalers, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    for i, scaler in enumerate(scalers):
        if (i + step) % 4 == 0:
            continue  # not seen this step
        amax = torch.rand((), generator=g) * 10
        if i == 5 and step == 3:
            amax = torch.tensor(float("nan"))
        quantized = step >= 2
        scaler.observe(amax, torch.tensor(i % 2) if quantized else None, 100)
        scaler.observe(amax * 0.5, torch.tensor(1) if quantized else None, 100)


@pytest.mark.parametrize("algo", ["max", "most_recent", "exp_smooth", "current"])
def test_batched_steps_equal_one_scaler_at_a_time(algo):
    single, batched = make(algo), make(algo)
    for step in range(7):
        feed(single, step), feed(batched, step)
        if step == 2:
            for s in single:
                s.seed_history()
            seed_all(batched)
        if step == 4:  # a skipped step
            for s in single:
                s.discard_step()
            discard_all(batched)
            continue
        for s in single:
            s.advance()
        advance_all(batched)
        for a, b in zip(single, batched):
            assert a.uses_current_scaling == b.uses_current_scaling and a.version == b.version
            for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
                assert torch.equal(x, y), (step, name)


def test_the_bank_is_views_and_is_rebuilt_after_a_move():
    scalers = make("max")
    (bank,) = [b for b in banks(scalers) if b.max_val == 15.0]
    assert banks(scalers)[0] is bank or banks(scalers)[1] is bank  # reused while intact
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
    assert all(b is not bank for b in banks(scalers) if b.max_val == 15.0)


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
    assert small == large < 100  # a constant (views and indexing included), not ~46 per scaler
