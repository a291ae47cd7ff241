"""FSDP2 (ModelParallelStrategy + fully_shard) and multi-node, on 2 CPU processes (gloo), through ``main.py``.

* FSDP2 and DDP on the same 2-process data layout train the same: equal losses (to rounding) and
  identical amax histories, a_hat and scales on every rank;
* a NaN gradient on one rank skips the step on both (the flag rides the per-step collective);
* an FSDP2 run killed at step 2 and resumed with ``--ckpt_path last`` (a sharded checkpoint directory)
  ends with the same scaler states and losses as the run that was not interrupted;
* 2 "nodes" x 1 process on the loopback interface (``NODE_RANK``, ``MASTER_ADDR=127.0.0.1``) gives the
  same histories and losses as 2 processes on one node;
* the FSDP2 run's sharded ``last.ckpt`` directory exports (hif8, compressed-tensors) with every weight code the
  training forward computed at the end of the run, validates on one process with the loss of the same state
  consolidated by Lightning's own tool, and inspects; an incomplete copy is refused in one line.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from tests._ddp_runs import ROOT, STEPS, SYNCED, ddp_config, dumps, run_main

pytestmark = pytest.mark.slow

FSDP = {"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
        "init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1}}


class NaNGradOnRank(L.Callback):
    """Poisons one local gradient shard on rank ``rank`` before optimizer step ``step``."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            from qat_app.fsdp import local_tensors

            grad = next(p.grad for p in pl_module.parameters() if p.grad is not None)
            local_tensors([grad])[0].view(-1)[0] = float("nan")


def _config(tmp, model_dir, corpus, strategy, extra_callbacks=()):
    path = ddp_config(tmp, model_dir, corpus)
    import yaml

    config = yaml.safe_load(open(path))
    config["trainer"]["strategy"] = strategy
    config["trainer"]["callbacks"] += list(extra_callbacks)
    open(path, "w").write(yaml.safe_dump(config))
    return path


def _losses(dump) -> list[float]:
    return [v[0] for v in dump["records"].values()]


def _assert_same_scalers(a, b, exact=True):
    assert a["scalers"].keys() == b["scalers"].keys()
    for key, value in a["scalers"].items():
        if key.rsplit(".", 1)[-1] in SYNCED:
            if exact:
                assert torch.equal(value, b["scalers"][key]), key
            else:
                torch.testing.assert_close(value, b["scalers"][key], rtol=1e-5, atol=0, msg=key)


@pytest.fixture(scope="module")
def fsdp_run(module_tmp, tiny_model_dir, tiny_corpus):
    """The 2-process FSDP2 fit; it also writes the weight codes its training forward computes at the end."""
    tmp = module_tmp("fsdp")
    codes = {"class_path": "tests._ddp_runs.WeightCodes", "init_args": {"path": str(tmp / "codes.pt")}}
    run_main(["fit", "--config", _config(tmp, tiny_model_dir, tiny_corpus, FSDP, [codes])])
    return tmp, dumps(tmp / "dump")


@pytest.fixture(scope="module")
def runs(module_tmp, tiny_model_dir, tiny_corpus, fsdp_run):
    tmp = module_tmp("ddp")
    run_main(["fit", "--config", _config(tmp, tiny_model_dir, tiny_corpus, "ddp")])
    return {"ddp": (tmp, dumps(tmp / "dump")), "fsdp": fsdp_run}


def test_fsdp_trains_like_ddp(runs):
    (_, (d0, d1)), (fsdp_dir, (f0, f1)) = runs["ddp"], runs["fsdp"]
    assert f0["global_step"] == f1["global_step"] == STEPS
    torch.testing.assert_close(_losses(f0), _losses(d0), rtol=1e-5, atol=0)
    torch.testing.assert_close(_losses(f1), _losses(d1), rtol=1e-5, atol=0)
    _assert_same_scalers(f0, f1)  # identical on both FSDP ranks
    _assert_same_scalers(f0, d0, exact=False)  # and the same as under DDP, to rounding
    last = fsdp_dir / "ckpt" / "last.ckpt"
    assert last.is_dir() and (last / ".metadata").is_file()  # a distributed (sharded) checkpoint


def test_fsdp_resume_is_exact(runs, tmp_path, tiny_model_dir, tiny_corpus):
    _, straight = runs["fsdp"]
    crash = {"class_path": "tests._cli_runs.CrashAt", "init_args": {"step": 2}}
    config = _config(tmp_path, tiny_model_dir, tiny_corpus, FSDP, [crash])
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=ROOT)
    crashed = subprocess.run([sys.executable, os.path.join(ROOT, "main.py"), "fit", "--config", config], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=300)
    assert crashed.returncode != 0 and "simulated node failure" in crashed.stderr
    assert (tmp_path / "ckpt" / "last.ckpt" / ".metadata").is_file()
    config = _config(tmp_path, tiny_model_dir, tiny_corpus, FSDP)  # the same run, without the crash
    run_main(["fit", "--config", config, "--ckpt_path", "last"])
    resumed = dumps(tmp_path / "dump")
    for r in range(2):
        assert resumed[r]["global_step"] == STEPS
        _assert_same_scalers(resumed[r], straight[r])
        after = {k: v for k, v in resumed[r]["records"].items() if int(k.split("/")[0]) >= 2}
        assert after == {k: v for k, v in straight[r]["records"].items() if int(k.split("/")[0]) >= 2}


def test_fsdp_nan_on_one_rank_skips_the_step_on_both(tmp_path, tiny_model_dir, tiny_corpus):
    poison = {"class_path": "tests.test_fsdp.NaNGradOnRank", "init_args": {"rank": 1, "step": 3}}
    run_main(["fit", "--config", _config(tmp_path, tiny_model_dir, tiny_corpus, FSDP, [poison])])
    r0, r1 = dumps(tmp_path / "dump")
    assert r0["skipped_steps"] == r1["skipped_steps"] == 1
    _assert_same_scalers(r0, r1)
    for dump in (r0, r1):
        assert all(torch.isfinite(v).all() for k, v in dump["scalers"].items() if k.endswith("amax_history"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_loopback_match_one_node(runs, tmp_path, tiny_model_dir, tiny_corpus):
    """What torchrun / SLURM do on two machines: one process per node, NODE_RANK 0 and 1, one master."""
    _, one_node = runs["ddp"]
    config = _config(tmp_path, tiny_model_dir, tiny_corpus, "ddp")
    port = str(_free_port())
    procs = []
    for node in range(2):
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=ROOT,
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(node), LOCAL_RANK="0", WORLD_SIZE="2")
        procs.append(subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "main.py"), "fit", "--config", config, "--trainer.num_nodes", "2",
             "--trainer.devices", "1"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-4000:]
    two_nodes = dumps(tmp_path / "dump")
    for r in range(2):
        assert two_nodes[r]["world_size"] == 2
        assert two_nodes[r]["records"] == one_node[r]["records"]  # same batches, same losses, same ranks
        _assert_same_scalers(two_nodes[r], one_node[r])


def test_one_process_ddp_and_fsdp2_agree_on_the_same_global_batch(tmp_path):
    """The recipe's core on one global batch: 1 process, 2-process DDP and 2-process FSDP2 (each rank half the
    batch). The warmup step's amax (a max: exact in any split) is identical everywhere; later steps see
    weights that differ by the rounding of the gradient average, so histories and losses agree to rounding.
    (Without a warmup, a first step with no history scales each rank by its own half's amax.)"""
    import torch.multiprocessing as mp

    from tests._dist_workers import equivalence_worker

    equivalence_worker(0, 1, "single", "", str(tmp_path))
    for mode in ("ddp", "fsdp"):
        mp.spawn(equivalence_worker, args=(2, mode, str(tmp_path / f"init_{mode}"), str(tmp_path)), nprocs=2, join=True)
    single = torch.load(tmp_path / "single_rank0.pt", weights_only=True)
    for mode in ("ddp", "fsdp"):
        r0, r1 = (torch.load(tmp_path / f"{mode}_rank{r}.pt", weights_only=True) for r in range(2))
        torch.testing.assert_close(r0["losses"], single["losses"], rtol=1e-5, atol=0)
        checked = 0
        for key, value in single["scalers"].items():
            if key.rsplit(".", 1)[-1] not in SYNCED:  # the clipped / seen counters are per rank
                continue
            assert torch.equal(r0["scalers"][key], r1["scalers"][key]), (mode, key)  # the ranks agree exactly
            if key.endswith("amax_history"):
                assert torch.equal(r0["scalers"][key][-1], value[-1]), (mode, key)  # the warmup step (oldest slot)
            torch.testing.assert_close(r0["scalers"][key], value, rtol=1e-5, atol=0, msg=f"{mode} {key}")
            checked += 1
        assert checked >= 6 * len(SYNCED) - 6


def _main(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, os.path.join(ROOT, "main.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def _val_loss(run_dir: Path, config: str, ckpt: str) -> float:
    """``main.py validate`` of ``ckpt`` on one process (no strategy: it reads files), in a run directory of its own."""
    done = _main("validate", "--config", config, "--ckpt_path", ckpt, "--trainer.devices", "1",
                 "--trainer.strategy", "auto", "--run_dir", str(run_dir))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return float(re.search(r"val/loss\W+([-+0-9.eE]+)", done.stdout).group(1))


def test_fsdp_run_exports_validates_and_inspects_from_its_sharded_checkpoint(fsdp_run, tmp_path):
    """The sharded ``last.ckpt`` directory, as it is: both exports hold exactly the codes the training forward
    computed from the live sharded weights and scales; validate gives the loss of the same state consolidated by
    Lightning's own tool; inspect reads it."""
    from lightning.fabric.utilities.load import _load_distributed_checkpoint

    from benchmarks.gpu_export_check import differing_codes
    from qat_app.export import main as export_main

    run, _ = fsdp_run
    last, config = run / "ckpt" / "last.ckpt", str(run / "config.yaml")
    assert (last / ".metadata").is_file() and (last / "meta.pt").is_file()  # a sharded checkpoint, as written
    for fmt in ("hif8", "compressed-tensors"):
        assert export_main(["--ckpt_path", str(last), "--out", str(tmp_path / fmt), "--format", fmt]) == 0
    trained = torch.load(run / "codes.pt", weights_only=True)
    assert len(trained) == 6  # blocks 1-2 of 3: gate, up, down
    result = differing_codes(trained, tmp_path / "hif8", tmp_path / "compressed-tensors")
    assert result == {"codes": sum(c.numel() for c in trained.values()), "differ_hif8": 0, "differ_fp8": 0}, result

    consolidated = tmp_path / "consolidated.ckpt"  # what lightning.fabric.utilities.consolidate_checkpoint writes
    torch.save(_load_distributed_checkpoint(last), consolidated)
    assert _val_loss(tmp_path / "v_dir", config, str(last)) == _val_loss(tmp_path / "v_file", config, str(consolidated))

    done = _main("inspect", "--config", config, "--ckpt_path", str(last), "--trainer.devices", "1",
                 "--trainer.strategy", "auto", "--run_dir", str(tmp_path / "inspect"), "--batches", "1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "inspect: 6 quantized matmuls" in done.stdout


def test_incomplete_sharded_checkpoint_is_refused_in_one_line(fsdp_run, tmp_path):
    run, _ = fsdp_run
    bad = tmp_path / "last.ckpt"
    shutil.copytree(run / "ckpt" / "last.ckpt", bad)
    (bad / "__1_0.distcp").unlink()  # one rank's shard never written (or not copied)
    before = sorted((p.name, p.stat().st_size) for p in bad.iterdir())
    done = _main("validate", "--config", str(run / "config.yaml"), "--ckpt_path", str(bad), "--trainer.devices", "1",
                 "--trainer.strategy", "auto", "--run_dir", str(tmp_path / "v"))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"sharded checkpoint {bad} is incomplete: missing __1_0.distcp" in errors[0], errors
    assert sorted((p.name, p.stat().st_size) for p in bad.iterdir()) == before  # nothing in it changed
