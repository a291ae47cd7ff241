"""qat_app.hif8.training.sync_and_advance, the per-step protocol, called directly on a converted tiny Llama.

Every expectation is computed here from what the scalers observed before the call (the history push and
the ``max`` estimate written out by hand), not read back from the code under test:

* a finite step advances every scaler once (the step amax enters slot 0, the window shifts, one more step
  recorded, a_hat / scale follow) and is not skipped;
* a non-finite step (the flag) is skipped: histories and scales untouched, nothing recorded, and the
  step's amax observations are discarded (they do not leak into the next step);
* data parallelism is decided by the process group's world size: one process makes no collective; with
  more than one rank, one MAX all-reduce per call carries every scaler's step amax and the skip flag;
* the cached weight codes are released after an advancing call (the optimizer is about to change the weights).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from qat_app.hif8.patch import convert_to_hif8_training, quantized_linears
from qat_app.hif8.recipe import HiF8Recipe, LayerSelection, RuntimeOptions
from qat_app.hif8.scaler_bank import SYNC_WIDTH
from qat_app.hif8.scaling import all_scalers
from qat_app.hif8.training import sync_and_advance

HISTORY = 4
STATE = ("amax_history", "a_hat", "scale", "steps_recorded")


def quantized_llama(seed: int = 0):
    """A 4-block random Llama with the MLPs of blocks 1-2 quantized (2 boundary blocks in high precision)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=2, num_key_value_heads=2, vocab_size=64))
    convert_to_hif8_training(model, HiF8Recipe(amax_algo="max", history_len=HISTORY, quantize_grads=True),
                             LayerSelection(high_precision_layers=2), RuntimeOptions(fused="off"))
    return model


def forward_backward(model, seed: int) -> torch.Tensor:
    torch.manual_seed(1000 + seed)  # the gradients' stochastic rounding draws from the global RNG
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(seed))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach()


def snapshot(model) -> list[dict[str, torch.Tensor]]:
    return [{k: getattr(s, k).detach().clone() for k in (*STATE, "step_amax", "step_seen")} for s in all_scalers(model)]


def expected_after_advance(before: dict[str, torch.Tensor], max_val: float, margin: float) -> dict[str, torch.Tensor]:
    """The ``max`` recipe by hand: a step that saw a finite amax pushes it into slot 0 (the oldest slot drops),
    a_hat is the window's max, scale = max_val / a_hat / 2^margin; a step that saw nothing changes nothing."""
    amax, history = before["step_amax"], before["amax_history"]
    if not (before["step_seen"] > 0 and torch.isfinite(amax)):
        return {k: before[k] for k in STATE}
    history = torch.cat([amax.view(1), history[:-1]])
    a_hat = history.max()
    return {"amax_history": history, "a_hat": a_hat, "scale": torch.tensor(max_val) / a_hat / 2.0**margin,
            "steps_recorded": before["steps_recorded"] + 1}


def assert_state(model, expected: list[dict[str, torch.Tensor]]) -> None:
    for scaler, want in zip(all_scalers(model), expected, strict=True):
        for key in STATE:
            got = getattr(scaler, key)
            if key == "scale":  # the division order may differ by one rounding from the code's
                torch.testing.assert_close(got, want[key].to(got.dtype), rtol=2 * torch.finfo(torch.float32).eps, atol=0)
            else:
                assert torch.equal(got, want[key].to(got.dtype)), (key, got, want[key])


@pytest.mark.parametrize("nonfinite", [None, False, torch.tensor(False)], ids=["none", "bool", "tensor"])
def test_a_finite_step_advances_every_scaler_once(nonfinite):
    model = quantized_llama()
    scalers = all_scalers(model)
    assert len(scalers) == 2 * 3 * 3  # 2 blocks x 3 MLP projections x (input, weight, grad)
    for step in range(HISTORY + 1):  # past a full window: the oldest amax drops out
        forward_backward(model, seed=step)
        before = snapshot(model)
        assert all(b["step_seen"] > 0 for b in before)  # every tensor was seen this step: nothing vacuous
        expected = [expected_after_advance(b, s.max_val, s.margin) for b, s in zip(before, scalers)]
        assert sync_and_advance(model, nonfinite=nonfinite).skipped is False
        assert_state(model, expected)
        assert all(int(s.steps_recorded) == step + 1 for s in scalers)
        assert all(float(s.step_amax) == 0 and float(s.step_seen) == 0 for s in scalers)  # next step starts afresh
        model.zero_grad()
    assert all((s.amax_history > 0).all() for s in scalers)


@pytest.mark.parametrize("flag", [True, torch.tensor(True)], ids=["bool", "tensor"])
def test_a_nonfinite_step_is_skipped_and_its_observations_discarded(flag):
    model = quantized_llama()
    scalers = all_scalers(model)
    forward_backward(model, seed=0)
    sync_and_advance(model)  # one recorded step: delayed scaling from now on
    model.zero_grad()

    forward_backward(model, seed=1)
    spiked = scalers[0]
    spiked.observe(torch.tensor(1e6), None, 1)  # the spike a bad step would bring: must not reach any history
    before = snapshot(model)
    assert sync_and_advance(model, nonfinite=flag).skipped is True
    assert_state(model, [{k: b[k] for k in STATE} for b in before])  # nothing moved, nothing recorded
    assert all(int(s.steps_recorded) == 1 for s in scalers)
    assert all(float(s.step_amax) == 0 and float(s.step_seen) == 0 for s in scalers)
    model.zero_grad()

    forward_backward(model, seed=2)  # the next step records its own amax only
    before = snapshot(model)
    assert float(before[0]["step_amax"]) < 1e6
    expected = [expected_after_advance(b, s.max_val, s.margin) for b, s in zip(before, scalers)]
    assert sync_and_advance(model, nonfinite=torch.tensor(False)).skipped is False
    assert_state(model, expected)
    assert float(spiked.amax_history.max()) < 1e6 and all(int(s.steps_recorded) == 2 for s in scalers)


def test_the_weight_codes_cache_is_released():
    model = quantized_llama()
    layers = [m for _, m in quantized_linears(model)]
    for step in range(2):  # the first step quantizes with current scaling, the second with the delayed scale
        forward_backward(model, seed=step)
        assert all(m._weight_cache is not None for m in layers), step  # made by the forward, held until the sync
        assert sync_and_advance(model).skipped is False
        assert all(m._weight_cache is None for m in layers), step
        model.zero_grad()


@pytest.fixture
def one_process_group(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_data_parallel_path_is_one_max_all_reduce_per_step(one_process_group, monkeypatch):
    calls = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        calls.append((tensor.numel(), op))
        return real_all_reduce(tensor, op=op, group=group, async_op=async_op)

    monkeypatch.setattr(dist, "all_reduce", counting_all_reduce)
    plain, parallel = quantized_llama(), quantized_llama()
    n = len(all_scalers(parallel))

    # one process in the group: not data parallel, no collective
    forward_backward(plain, seed=0), forward_backward(parallel, seed=0)
    assert sync_and_advance(parallel, nonfinite=torch.tensor(False)).skipped is False
    assert sync_and_advance(plain, nonfinite=torch.tensor(False)).skipped is False
    assert calls == []

    # the group says 2 ranks: the data-parallel path (here over the one real rank, so MAX is the identity)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    for step in (1, 2):
        plain.zero_grad(), parallel.zero_grad()
        forward_backward(plain, seed=step), forward_backward(parallel, seed=step)
        with monkeypatch.context() as m:  # the reference run stays on the one-process path
            m.setattr(dist, "get_world_size", lambda group=None: 1)
            assert sync_and_advance(plain, nonfinite=torch.tensor(False)).skipped is False
        assert sync_and_advance(parallel, nonfinite=torch.tensor(False)).skipped is False
        # one MAX all-reduce per step on one flat buffer: (step amax, seen, clipped, what-if clipped) per scaler
        # + the skip flag
        assert calls == [(SYNC_WIDTH * n + 1, dist.ReduceOp.MAX)] * step
        for a, b in zip(all_scalers(parallel), all_scalers(plain), strict=True):
            for key in STATE:
                assert torch.equal(getattr(a, key), getattr(b, key)), key

    # the skip decision rides the same collective: the reduced flag skips, nothing is recorded
    parallel.zero_grad()
    forward_backward(parallel, seed=3)
    before = snapshot(parallel)
    assert sync_and_advance(parallel, nonfinite=torch.tensor(True)).skipped is True
    assert len(calls) == 3
    assert_state(parallel, [{k: b[k] for k in STATE} for b in before])
    # without a flag there is nothing to decide: still one collective, never a skip
    forward_backward(parallel, seed=4)
    assert sync_and_advance(parallel).skipped is False and len(calls) == 4 and calls[-1][0] == SYNC_WIDTH * n
