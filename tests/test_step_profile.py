"""Where a step's time goes: the step profiler's categories, on real torch.profiler events and in a real fit."""

import io
import json
import os

import pytest
import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

import main as cli
from qat_app.config import QuantConfig
from qat_app.errors import ConfigError
from qat_app.eval.records import PROFILE_FILE
from qat_app.hif8 import profiling
from qat_app.hif8.linear import HiF8Linear
from qat_app.hif8.training import end_warmup, start_warmup, sync_and_advance
from qat_app.step_profile import (CATEGORIES, CHECKPOINT, COMMUNICATION, DATA, FRAMEWORK, GEMM, HEALTH, OPTIMIZER, OTHER,
                                  QUANTIZE, SCALER, StepProfile, StepProfiler, categorize)
from tests._cli_runs import STEPS, WARMUP, write_config


def test_profiled_is_a_range_only_while_a_profiler_records():
    assert not isinstance(profiling.profiled(profiling.QUANTIZE), record_function)
    with profile(activities=[ProfilerActivity.CPU]):
        assert isinstance(profiling.profiled(profiling.QUANTIZE), record_function)


def test_each_op_counts_in_the_innermost_categorized_range():
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("[pl][Strategy]SingleDeviceStrategy.training_step"):  # a container: no category
            a @ b  # a matmul outside every range: gemm
            a + b  # any other op: other compute
            with profiling.profiled(profiling.QUANTIZE):
                a * 2
                with profiling.profiled(profiling.GEMM):  # inner wins
                    a @ b
            with profiling.profiled(profiling.HEALTH):
                torch.dot(a.flatten(), b.flatten())  # a product inside health is health's
        with record_function("Optimizer.step#AdamW.step"):
            a.add_(b)
            with record_function("[pl][Strategy]SingleDeviceStrategy.backward"):  # Lightning's closure: not the
                c = a @ b  # optimizer's, though it runs inside Optimizer.step
            c.mul_(2)  # back in the optimizer
        with record_function("[pl][_TrainingEpochLoop].train_dataloader_next"):
            b.clone()
        with record_function("[pl][Callback]ModelCheckpoint{}.on_train_batch_end"):
            with record_function("[pl][Strategy]SingleDeviceStrategy.save_checkpoint"):  # inner wins
                torch.save(a, io.BytesIO())
        with profiling.profiled(profiling.SCALER_UPDATE):
            a.amax()
        with record_function("c10d::allreduce_"):  # a collective, wherever it runs
            a.sum()
    events = prof.events()
    cpu, _ = categorize(events)
    assert set(cpu) == set(CATEGORIES)
    for category in (GEMM, OTHER, QUANTIZE, HEALTH, OPTIMIZER, DATA, SCALER, COMMUNICATION, CHECKPOINT, FRAMEWORK):
        assert cpu[category] > 0, category
    assert sum(cpu.values()) == pytest.approx(sum(e.self_cpu_time_total for e in events) / 1e6, rel=1e-9)
    names = {e.name for e in events}
    assert "aten::mm" in names and "aten::dot" in names
    # the dot inside health is not GEMM time: GEMM holds the two matmuls, no more than the unmarked one and the
    # gemm range take in all
    mm = sum(e.self_cpu_time_total for e in events if e.name == "aten::mm") / 1e6
    outer = [e for e in events if e.name == "aten::matmul" and e.cpu_parent.name.startswith("[pl]")]
    ranged = [e for e in events if e.name == profiling.GEMM]
    assert len(outer) == 2 and len(ranged) == 1
    assert mm <= cpu[GEMM] <= (sum(e.cpu_time_total for e in outer) + ranged[0].cpu_time_total) / 1e6
    optimizer_ops = [e for e in events if e.name in ("aten::add_", "aten::mul_")]
    assert cpu[OPTIMIZER] >= sum(e.self_cpu_time_total for e in optimizer_ops) / 1e6 * (1 - 1e-9)


def test_the_digest_table_and_its_round_trip():
    cpu = dict.fromkeys(CATEGORIES, 0.0) | {QUANTIZE: 0.2, GEMM: 1.0, SCALER: 0.05, HEALTH: 0.05, OTHER: 0.6}
    result = StepProfile(2, 5, "cpu", 2.0, cpu)
    assert result.unranged_s == pytest.approx(0.1)
    assert result.cpu_overhead == pytest.approx(0.3 / 1.7)
    table = result.table()
    assert "2 optimizer step(s) from step 5 on cpu, 2.000 s per step" in table
    assert "quantize                      0.200   10.0%" in table and "\noptimizer " not in table  # zero rows left out
    assert "CPU +17.6%" in table
    assert StepProfile.from_dict(json.loads(json.dumps(result.to_dict()))) == result


def test_a_negative_step_count_is_one_line_naming_the_field():
    with pytest.raises(ConfigError, match=r"profile\.steps: must be >= 0"):
        StepProfiler(steps=-1)


@pytest.mark.slow
def test_a_profiled_fit_writes_the_digest_and_its_categories_add_up(tmp_path, tiny_model_dir, tiny_corpus, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = write_config(tmp_path, tiny_model_dir, tiny_corpus)
    run = cli.cli_main(["fit", "--config", config, "--profile.steps", "2", "--profile.trace", "true"])
    trainer = run.trainer
    assert isinstance(trainer.profiler, StepProfiler)
    data = json.load(open(os.path.join(trainer.log_dir, PROFILE_FILE)))
    result = StepProfile.from_dict(data)
    first = min(WARMUP + 1 + 1, STEPS - 2)  # past the switch and the first logging step; within the run
    assert (result.steps, result.first_step, result.device_type) == (2, first, "cpu")
    for category in (QUANTIZE, GEMM, SCALER, HEALTH, OPTIMIZER, DATA, OTHER):
        assert result.cpu_s[category] > 0, category
    assert result.cpu_s[COMMUNICATION] == 0  # one process
    # every op's time is in a category: what is in no range (Python between Lightning's actions) is under 10 %
    assert 0 <= result.unranged_s < 0.1 * result.wall_s
    assert 0 < result.cpu_overhead < 10
    assert os.path.getsize(os.path.join(trainer.log_dir, "profile_trace.json")) > 0
    summary = open(os.path.join(trainer.log_dir, "run_summary.txt")).read()
    assert f"profile       Step profile: 2 optimizer step(s) from step {first} on cpu" in summary
    assert "quantization overhead vs a BF16 step" in summary
    metrics = open(os.path.join(trainer.log_dir, "metrics.csv")).readline()
    assert "profile/quantize_s" in metrics and "profile/quantization_overhead" in metrics


def test_profile_and_trainer_profiler_together_are_refused(tmp_path, tiny_model_dir, tiny_corpus, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = write_config(tmp_path, tiny_model_dir, tiny_corpus)
    with pytest.raises(ConfigError, match=r"profile\.steps: trainer\.profiler is set too"):
        cli.cli_main(["fit", "--config", config, "--profile.steps", "1", "--trainer.profiler", "simple"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the GPU column")
def test_gpu_time_is_counted_per_category_on_cuda():
    layer = HiF8Linear(512, 512, **QuantConfig(fused="auto").layer_options()).cuda()
    x = torch.randn(64, 512, device="cuda")
    start_warmup(layer)
    layer(x).sum().backward()
    sync_and_advance(layer)
    end_warmup(layer)
    layer(x).sum().backward()  # compile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        layer(x).sum().backward()
        sync_and_advance(layer)
        torch.cuda.synchronize()
    _, device = categorize(prof.events())
    assert device[QUANTIZE] > 0 and device[GEMM] > 0 and device[SCALER] > 0


def test_a_real_collective_is_communication(tmp_path):
    """The names torch records for gloo's all-reduce and all-gather (what DDP and FSDP2 run) are caught."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        t = torch.randn(1 << 16)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            dist.all_reduce(t)
            dist.all_gather_into_tensor(torch.empty_like(t), t)
        cpu, _ = categorize(prof.events())
        collective = [e for e in prof.events() if "allreduce" in e.name or "allgather" in e.name]
    finally:
        dist.destroy_process_group()
    assert {e.name.split("::")[0] for e in collective} and cpu[COMMUNICATION] > 0
    assert cpu[COMMUNICATION] >= sum(e.self_cpu_time_total for e in collective) / 1e6 * (1 - 1e-9)  # all of theirs
