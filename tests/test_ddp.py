"""Data-parallel consistency on 2 CPU processes (gloo).

* ``sync_step_amax`` on a real 2-process group: one all-reduce per step, MAX of the step amax, NaN on one
  rank becomes inf on both (the step is recorded by neither), a bad-step flag on one rank is seen by both;
* ``python main.py fit`` with ``strategy=ddp, devices=2``: the ranks read different data, and after a few
  steps every amax history, a_hat and scale is identical on both ranks; resuming that run from its
  step-2 checkpoint gives every rank its own data position and RNG state back (identical losses).
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from qat_app.hif8.scaler_bank import SYNC_WIDTH
from tests._ddp_runs import STEPS, SYNCED, ddp_config, dumps, run_main
from tests._dist_workers import sync_worker


# ----------------------------------------------------------------------------- sync_step_amax
def test_sync_step_amax_two_processes(tmp_path):
    mp.spawn(sync_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))
    for a, b in zip(r0["state"], r1["state"]):  # identical histories, a_hat and scales on both ranks
        assert a.keys() == b.keys()
        for key in SYNCED:
            assert torch.equal(a[key], b[key]), key
    s0, s1, s2 = r0["state"]
    assert s0["amax_history"].tolist() == [2.0, 0.0, 0.0, 0.0]  # the NaN step was not pushed
    assert int(s0["steps_recorded"]) == 1 and float(s0["scale"]) == 15.0 / 2.0
    assert s1["amax_history"].tolist() == [7.0, 5.0, 0.0, 0.0]  # MAX over the ranks, each step
    assert s2["amax_history"].tolist()[0] == 3.0 and int(s2["steps_recorded"]) == 1  # seen on rank 1 only
    assert all(torch.isfinite(s[k]).all() for s in r0["state"] for k in ("amax_history", "a_hat", "scale"))
    assert float(s0["last_amax"]) == float("inf")  # the NaN step is reported as inf (on both ranks), not recorded
    assert (r0["bad1"], r0["bad2"], r0["bad3"]) == (r1["bad1"], r1["bad2"], r1["bad3"]) == (False, False, True)
    # one collective per step on one flat buffer (3 scalers x SYNC_WIDTH + the flag)
    assert r0["calls"] == r1["calls"] == [3 * SYNC_WIDTH + 1] * 3


# ----------------------------------------------------------------------------- DDP fit via main.py
@pytest.fixture(scope="module")
def ddp_run(module_tmp, tiny_model_dir, tiny_corpus):
    tmp = module_tmp("ddp")
    run_main(["fit", "--config", ddp_config(tmp, tiny_model_dir, tiny_corpus)])
    return tmp, dumps(tmp / "dump")


@pytest.mark.slow
def test_ddp_ranks_hold_identical_histories_and_scales(ddp_run):
    _, (r0, r1) = ddp_run
    assert r0["world_size"] == r1["world_size"] == 2 and r0["global_step"] == r1["global_step"] == STEPS
    # different data on the two ranks (the datamodule shards by rank), so different local amax ...
    batches0 = {h for _, h in r0["records"].values()}
    batches1 = {h for _, h in r1["records"].values()}
    assert len(r0["records"]) == len(r1["records"]) == 2 * STEPS and not batches0 & batches1
    assert [v[0] for v in r0["records"].values()] != [v[0] for v in r1["records"].values()]
    # ... but after the per-step MAX all-reduce every history / a_hat / scale is the same on both ranks
    assert r0["scalers"].keys() == r1["scalers"].keys()
    checked = 0
    for key, value in r0["scalers"].items():
        if key.rsplit(".", 1)[-1] in SYNCED:
            assert torch.equal(value, r1["scalers"][key]), key
            checked += 1
    assert checked > 0
    histories = [v for k, v in r0["scalers"].items() if k.endswith("amax_history")]
    assert all(torch.isfinite(h).all() and (h[:STEPS] > 0).all() for h in histories)


@pytest.mark.slow
def test_ddp_resume_restores_every_rank(ddp_run, tmp_path, tiny_model_dir, tiny_corpus):
    straight_dir, straight = ddp_run
    ckpt = straight_dir / "ckpt" / "epoch=0-step=2.ckpt"
    saved = torch.load(ckpt, weights_only=True)
    loader_state = saved["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert loader_state["world_size"] == 2 and len(loader_state["data_parallel_states"]) == 2
    assert saved["callbacks"]["RNGStateCallback"]["world_size"] == 2
    run_main(["fit", "--config", ddp_config(tmp_path, tiny_model_dir, tiny_corpus), "--ckpt_path", str(ckpt)])
    for want, got in zip(straight, dumps(tmp_path / "dump")):
        expected = {k: v for k, v in want["records"].items() if int(k.split("/")[0]) >= 2}
        assert got["records"] == expected  # same batches and bit-identical losses on each rank
        for key, value in want["scalers"].items():
            assert torch.equal(value, got["scalers"][key]), key


def test_saturation_counts_are_summed_over_ranks(tmp_path):
    """2 gloo processes, each with half of the batch, report what one process reports on all of it."""
    from callbacks.saturation import TOTAL_COUNT_FIELDS, TOTAL_FIELDS
    from qat_app.hif8.step_record import COUNT_FIELDS, FIELDS, named_scalers
    from qat_app.hif8.counters import gather
    from qat_app.hif8.scaler_bank import sync_step_amax
    from tests._dist_workers import saturation_batch, saturation_counts_worker, saturation_model

    mp.spawn(saturation_counts_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    model = saturation_model()
    per_step = []
    for step in range(2):
        model(saturation_batch(step))
        sync_step_amax([s for _, s in named_scalers(model)])
        for _, scaler in named_scalers(model):
            scaler.advance()
        per_step.append(gather(named_scalers(model), FIELDS, COUNT_FIELDS))
    totals = gather(named_scalers(model), TOTAL_FIELDS, TOTAL_COUNT_FIELDS)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert got["per_step"] == per_step and got["totals"] == totals
    clipped_input, clipped_weight = totals[0][6], totals[1][6]
    assert clipped_input > 0 and clipped_weight > 0  # both tensors clipped: the test is not vacuous
    assert totals[0][7] == 2 * 8 * 16  # every input element of both steps, counted once
