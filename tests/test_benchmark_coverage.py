"""Every selected benchmark example scored, exactly once, at every validation: whatever
``trainer.limit_val_batches`` says (it limits the held-out LM validation only), and on any number of ranks
(whole one-process batches dealt to the ranks, the padding counted once)."""

from __future__ import annotations

import csv
import glob
import json
import logging
import os
from collections import Counter
from types import SimpleNamespace

import lightning
import pytest
import yaml
from jsonargparse import Namespace
from torch.utils.data import DataLoader, DistributedSampler

import main as cli
from qat_app import preflight
from qat_app.data.benchmarks import BenchmarkDataModule, WholeBatchSampler
from qat_app.data.pretrain import PretrainDataModule, limited_items
from qat_app.errors import ConfigError
from tests._cli_runs import TINY_BENCHMARKS, write_config
from tests._ddp_runs import run_main

BENCH = "qat_app.data.benchmarks.BenchmarkDataModule"
SUBJECTS = ["high_school_geography", "marketing"]


# ------------------------------------------------------------------------------------------- the sampler
@pytest.mark.parametrize("n,batch_size,world", [(25, 4, 2), (7, 8, 3), (16, 4, 4), (30, 7, 3), (5, 2, 4), (1, 4, 2),
                                                (80, 16, 1)])
def test_ranks_get_whole_one_process_batches_and_as_many_of_them(n, batch_size, world):
    data = list(range(n))
    one = [tuple(b.tolist()) for b in DataLoader(data, batch_size=batch_size)]
    samplers = [WholeBatchSampler(data, batch_size, world, rank) for rank in range(world)]
    per_rank = [[tuple(b.tolist()) for b in DataLoader(data, batch_size=batch_size, sampler=s)] for s in samplers]
    assert all(isinstance(s, DistributedSampler) for s in samplers)  # Lightning keeps it, injects none of its own
    assert len({len(batches) for batches in per_rank}) == 1  # every rank runs as many batches
    assert all(len(batches) == s.num_batches for batches, s in zip(per_rank, samplers))
    seen = Counter(b for batches in per_rank for b in batches)
    assert set(seen) == set(one)  # exactly the one-process batches, each example in its one-process batch
    padding = world * samplers[0].num_batches - len(one)
    assert seen[one[0]] == 1 + padding and all(seen[b] == 1 for b in one[1:])  # repeats: whole copies of batch 0


def test_lm_limit_follows_lightnings_rule():
    assert limited_items(10, 4, None) == 10 and limited_items(10, 4, 1.0) == 10
    assert limited_items(10, 4, 2) == 8 and limited_items(10, 4, 5) == 10 and limited_items(10, 4, 0) == 0
    assert limited_items(10, 4, 0.5) == 4  # int(3 batches x 0.5) = 1 batch
    with pytest.raises(ConfigError, match=r"data\.limit_val_batches must be null, a number of batches >= 0 or a "
                                          r"fraction in \[0, 1\], got 1\.5"):
        PretrainDataModule(dataset="embedded:boolq-passages", limit_val_batches=1.5)


# ------------------------------------------------------------------------- a Lightning limit cutting a task
def test_a_trainer_limit_that_would_cut_a_benchmark_is_refused_before_any_batch(embedded_tokenizer):
    data = BenchmarkDataModule(tasks=["mmlu"], mmlu_subjects=SUBJECTS, limit=40, batch_size=16, source="local")
    data.set_tokenizer(embedded_tokenizer)
    one, two = (SimpleNamespace(distributed_sampler_kwargs=None if w == 1 else {"num_replicas": w, "rank": 0})
                for w in (1, 2))
    with pytest.raises(ConfigError, match=r"^trainer\.limit_val_batches=2 would cut benchmark mmlu to 2 of its 5 "
                                          r"batches a rank \(32 of 80 selected examples scored\); "
                                          r".*data\.init_args\.limit_val_batches"):
        data.check_limit(SimpleNamespace(limit_val_batches=2, **vars(one)))
    with pytest.raises(ConfigError, match=r"limit_val_batches=2 would cut benchmark mmlu to 2 of its 3 batches a rank "
                                          r"\(64 of 80 selected"):
        data.check_limit(SimpleNamespace(limit_val_batches=2, **vars(two)))
    with pytest.raises(ConfigError, match=r"^trainer\.limit_test_batches=0\.5 would cut benchmark mmlu to 2 of its 5"):
        data.check_limit(SimpleNamespace(limit_test_batches=0.5, **vars(one)), "test")
    for limit, trainer in ((5, one), (3, two), (1.0, one), (0, one), (None, one)):  # enough, all, off: nothing cut
        data.check_limit(SimpleNamespace(limit_val_batches=limit, **vars(trainer)))

    class Counting(lightning.LightningModule):
        steps = 0

        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            Counting.steps += 1

    trainer = lightning.Trainer(accelerator="cpu", devices=1, limit_val_batches=2, logger=False,
                                enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ConfigError, match=r"would cut benchmark mmlu to 2 of its 5 batches"):
        trainer.validate(Counting(), datamodule=data)
    assert Counting.steps == 0


# ----------------------------------------------------------------------------- the command line
def _validate_config(tmp_path, name: str, **data_args) -> str:
    config = {
        "trainer": {"accelerator": "cpu", "devices": 1, "precision": "32-true", "enable_progress_bar": False,
                    "logger": [{"class_path": "lightning.pytorch.loggers.CSVLogger",
                                "init_args": {"save_dir": str(tmp_path / name), "name": "logs"}}]},
        "warmup": {"warmup_steps": 0},
        "data": {"class_path": BENCH, "init_args": {"source": "local", **data_args}},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _records(log_dir) -> list[dict]:
    (path,) = glob.glob(os.path.join(log_dir, "benchmark_samples", "val_step*.jsonl"))
    return [json.loads(line) for line in open(path)]


def test_limit_val_batches_cannot_cut_mmlu_reproduction(tmp_path, tiny_model_dir, caplog):
    """The issue's reproduction: 2 subjects x 40, batches of 16, --trainer.limit_val_batches 2 scored 32 (the first
    subject's first two batches; marketing never); now all 80."""
    config = _validate_config(tmp_path, "repro", tasks=["mmlu"], mmlu_subjects=SUBJECTS, limit=40, batch_size=16)
    with caplog.at_level(logging.INFO):
        run = cli.cli_main(["validate", "--config", config, "--model.model_name", str(tiny_model_dir),
                            "--model.quant.enabled", "false", "--trainer.limit_val_batches", "2"])
    metrics = run.trainer.callback_metrics
    assert float(metrics["val/mmlu/count"]) == 80 and float(metrics["val/mmlu/selected"]) == 80
    assert {"val/mmlu/high_school_geography/acc", "val/mmlu/marketing/acc"} <= set(metrics)
    rows = _records(run.trainer.log_dir)
    assert Counter(r["subject"] for r in rows) == {"high_school_geography": 40, "marketing": 40}
    assert {r["selected"] for r in rows} == {80}
    assert sum(r["acc"] for r in rows) / 80 == pytest.approx(float(metrics["val/mmlu/acc"]))
    assert "benchmark examples scored / selected: mmlu 80/80" in caplog.text
    assert "trainer.limit_val_batches=2 not applied: this data has no held-out LM validation" in caplog.text


def _metrics(log_dir) -> dict[str, float]:
    rows = list(csv.DictReader(open(os.path.join(log_dir, "metrics.csv"))))
    return {k: float(v) for row in rows for k, v in row.items() if k.startswith("val/") and v}


@pytest.mark.slow
def test_two_gloo_processes_score_exactly_what_one_does(tmp_path, tiny_model_dir):
    """25 ARC and 30 MMLU examples in batches of 6: 5 batches each, so the second rank repeats a batch (padding)."""
    args = dict(tasks=["arc_challenge", "mmlu"], mmlu_subjects=SUBJECTS, limit={"arc_challenge": 25, "mmlu": 15},
                batch_size=6)
    assert WholeBatchSampler(list(range(25)), 6, 2, 1).num_batches * 2 * 6 > 25  # padding does occur
    runs = {}
    for world in (1, 2):
        config = _validate_config(tmp_path, f"w{world}", **args)
        run_main(["validate", "--config", config, "--model.model_name", str(tiny_model_dir), "--model.quant.enabled",
                  "false", "--trainer.devices", str(world), "--trainer.strategy", "ddp" if world > 1 else "auto",
                  "--trainer.limit_val_batches", "1"])
        (log_dir,) = glob.glob(str(tmp_path / f"w{world}" / "logs" / "version_*"))
        runs[world] = (_metrics(log_dir), _records(log_dir))
    (m1, r1), (m2, r2) = runs[1], runs[2]
    assert m1["val/arc_challenge/count"] == m1["val/arc_challenge/selected"] == 25
    assert m1["val/mmlu/count"] == m1["val/mmlu/selected"] == 30
    assert m2 == m1  # counts, selected, acc, acc_norm, per subject and category
    key = lambda r: (r["task"], r["subject"] or "", r["doc_id"])  # noqa: E731
    assert len(r1) == len({key(r) for r in r1}) == 55
    assert sorted(r2, key=key) == sorted(r1, key=key)  # every field, log-likelihoods bit for bit


@pytest.mark.slow
def test_fsdp2_on_two_processes_scores_what_one_process_does(tmp_path, tiny_model_dir):
    """MMLU 2 subjects x 4 in batches of 3 under FSDP2 on 2 processes: every forward of a sharded model is a
    collective, so it runs one forward a batch whatever prefix its rows share (no separate prefix forward on one
    rank alone), and scores the same examples as one process, to rounding."""
    args = dict(tasks=["mmlu"], mmlu_subjects=SUBJECTS, limit=4, batch_size=3)
    fsdp2 = json.dumps({"class_path": "lightning.pytorch.strategies.ModelParallelStrategy",
                        "init_args": {"data_parallel_size": 2, "tensor_parallel_size": 1}})
    runs = {}
    for world, strategy in ((1, "auto"), (2, fsdp2)):
        config = _validate_config(tmp_path, f"w{world}", **args)
        run_main(["validate", "--config", config, "--model.model_name", str(tiny_model_dir), "--model.quant.enabled",
                  "false", "--trainer.devices", str(world), "--trainer.strategy", strategy], timeout=300)
        (log_dir,) = glob.glob(str(tmp_path / f"w{world}" / "logs" / "version_*"))
        runs[world] = (_metrics(log_dir), _records(log_dir))
    (m1, r1), (m2, r2) = runs[1], runs[2]
    assert m1["val/mmlu/count"] == m2["val/mmlu/count"] == m2["val/mmlu/selected"] == 8
    key = lambda r: (r["subject"], r["doc_id"])  # noqa: E731
    assert sorted(map(key, r2)) == sorted(map(key, r1)) and len(r1) == 8
    for one, two in zip(sorted(r1, key=key), sorted(r2, key=key)):  # the prefix in front: the same scores, rounded
        assert two["loglik"] == pytest.approx(one["loglik"], rel=1e-4, abs=1e-4)


# ---------------------------------------------------------------------------------- routing and a fit
def _cfg(data_class: str, trainer: dict, init_args: dict | None = None) -> Namespace:
    return Namespace(trainer=Namespace(**trainer),
                     data=Namespace(class_path=data_class, init_args=Namespace(**(init_args or {}))))


def test_main_moves_limit_val_batches_to_the_lm_validation():
    pretrain = "qat_app.data.pretrain.PretrainDataModule"
    cfg = _cfg(pretrain, {"limit_val_batches": 50}, {"limit_val_batches": None})
    preflight.route_limit_val_batches(cfg)
    assert cfg.data.init_args.limit_val_batches == 50 and cfg.trainer.limit_val_batches is None
    preflight.route_limit_val_batches(cfg)  # a saved config: nothing more to move
    assert cfg.data.init_args.limit_val_batches == 50 and cfg.trainer.limit_val_batches is None
    for off in (0, 0.0, 1.0, None):  # validation off / all batches: stays the trainer's
        cfg = _cfg(pretrain, {"limit_val_batches": off}, {"limit_val_batches": None})
        preflight.route_limit_val_batches(cfg)
        assert cfg.trainer.limit_val_batches == off and cfg.data.init_args.limit_val_batches is None
    cfg = _cfg(BENCH, {"limit_val_batches": 0.25, "limit_test_batches": 3})
    preflight.route_limit_val_batches(cfg)
    assert cfg.trainer.limit_val_batches is None and cfg.trainer.limit_test_batches is None
    with pytest.raises(ConfigError, match=r"^trainer\.limit_val_batches=2 and data\.init_args\.limit_val_batches=3: "
                                          r"both limit the held-out LM validation; set one$"):
        preflight.route_limit_val_batches(_cfg(pretrain, {"limit_val_batches": 2}, {"limit_val_batches": 3}))


@pytest.mark.slow
def test_fit_limits_the_lm_validation_and_scores_every_benchmark_example(tmp_path, tiny_model_dir, tiny_corpus):
    config = write_config(tmp_path, tiny_model_dir, tiny_corpus, **{
        "data.init_args.benchmarks": TINY_BENCHMARKS,
        "trainer.limit_val_batches": 1})
    run = cli.cli_main(["fit", "--config", config])
    trainer, data = run.trainer, run.trainer.datamodule
    assert trainer.limit_val_batches == 1.0 and data.limit_val_batches == 1  # moved to the LM loader
    unlimited = PretrainDataModule(data_files=str(tiny_corpus), dataset=None, seq_len=32, micro_batch_size=2,
                                   val_documents=4, tokenizer=str(tiny_model_dir))
    assert unlimited.val_blocks(0, 1).shape[0] > 2 == data.val_blocks(0, 1).shape[0]  # one batch of 2 blocks
    metrics = _metrics(trainer.log_dir)
    for task in ("arc_challenge", "mmlu"):
        assert metrics[f"val/{task}/count"] == metrics[f"val/{task}/selected"] == 12
    assert "forget/kl" in trainer.callback_metrics  # the initial top-k cache covers the limited LM blocks
    paths = glob.glob(os.path.join(trainer.log_dir, "benchmark_samples", "val_step*.jsonl"))
    assert len(paths) >= 2  # the initial model (step 0) and every later validation
    for path in paths:
        scored = Counter(json.loads(line)["task"] for line in open(path))
        assert scored == {"arc_challenge": 12, "mmlu": 12}, path


# ------------------------------------------------------------------------- records and report: n of N
def test_records_and_report_give_scored_against_selected(tmp_path):
    import torch

    from qat_app import report as rp
    from qat_app.eval.records import read_records, write_benchmark_records
    from tests._report_fixtures import write_csv

    columns = {"example_id": torch.tensor([0, 1]), "gold": torch.tensor([0, 1]), "pred": torch.tensor([0, 0]),
               "pred_norm": torch.tensor([0, 0]), "acc": torch.tensor([1.0, 0.0]), "acc_norm": torch.tensor([1.0, 0.0]),
               "loglik": torch.tensor([[-1.0, -2.0], [-1.0, -3.0]])}
    path = write_benchmark_records({"arc_challenge": columns}, None, str(tmp_path), "val", 5, {"arc_challenge": 3})
    rows = read_records(path)
    assert [(row["task"], row["selected"]) for row in rows] == [("arc_challenge", 3)] * 2  # 2 scored of 3 selected

    for name, count in (("base", 80), ("qat", 32)):
        write_csv(tmp_path / name / "logs" / "version_0" / "metrics.csv", [
            {"step": 0, "train/loss": 2.0}, {"step": 1, "train/loss": 1.5},
            {"step": 1, "val/mmlu/acc": 0.3, "val/mmlu/count": count, "val/mmlu/selected": 80}])
    report = rp.build_report(tmp_path / "base", [tmp_path / "qat"], tmp_path / "out", labels=["BF16", "HiF8"])
    md = (tmp_path / "out" / "results.md").read_text()
    assert "- baseline `BF16`: " in md
    assert "  - benchmark examples scored / selected (last validation): mmlu 80/80" in md
    assert "  - benchmark examples scored / selected (last validation): mmlu 32/80" in md
    assert ("`HiF8`: its last validation did not score every selected benchmark example (mmlu 32/80 scored / "
            "selected)") in md
    assert report["qat"][0]["scored"] == {"mmlu": (32, 80)} and report["baseline"]["scored"] == {"mmlu": (80, 80)}
