"""The TensorBoard dashboard and the memory breakdown: a tiny fit's event file read back with TensorBoard's own
EventAccumulator holds the custom-scalars layout (every category, and the charts' regexes match the tags the run
wrote) and the mem/* scalars, equal to the bytes counted independently from the model and the optimizer;
the layout is a no-op without a TensorBoard logger; DTensor shards are counted by their local part."""

from __future__ import annotations

import re
import tempfile
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.custom_scalar import layout_pb2

import main as cli
from callbacks import AmaxSaturationCallback, MemoryMonitor, TensorBoardDashboard
from callbacks.dashboard import LAYOUT, PER_TENSOR, layout_for
from callbacks.memory import GRADS_MB, MIB, OPTIMIZER_MB, PARAMS_MB, RSS_MB, tensor_bytes
from qat_app.hif8 import fallback as core_fallback
from qat_app.hif8 import step_record
from tests._cli_runs import TINY_BENCHMARKS, WARMUP, write_config

LAYOUT_TAG = "custom_scalars__config__"  # where SummaryWriter.add_custom_scalars puts the layout
STEPS, EVERY = 5, 2
# categories whose tags this codebase's tiny fit writes (health / what-if need the core's statistics, forgetting
# needs benchmarks: their charts are checked for presence only)
WRITTEN_HERE = ("saturation", "training", "memory")


def _read(log_dir) -> EventAccumulator:
    events = EventAccumulator(log_dir, size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def _layout(events: EventAccumulator) -> dict[str, dict[str, list[str]]]:
    [written] = events.Tensors(LAYOUT_TAG)
    layout = layout_pb2.Layout.FromString(written.tensor_proto.string_val[0])
    def tags(chart):  # a multiline chart's regexes, or a margin chart's value, lower and upper tags
        if chart.HasField("margin"):
            return [t for series in chart.margin.series for t in (series.value, series.lower, series.upper)]
        return list(chart.multiline.tag)

    return {c.title: {chart.title: tags(chart) for chart in c.chart} for c in layout.category}


def independent_parameter_bytes(model: torch.nn.Module) -> int:
    """Each storage once (the tiny Llama ties its embedding and output weights)."""
    by_storage = {p.data_ptr(): p for _, p in model.named_parameters(remove_duplicate=False)}
    return sum(p.numel() * p.element_size() for p in by_storage.values())


@pytest.fixture(scope="module")
def tensorboard_fit(module_tmp, tiny_model_dir, tiny_corpus):
    tmp = module_tmp("dashboard")
    config = write_config(tmp, tiny_model_dir, tiny_corpus, **{
        "trainer.max_steps": STEPS, "trainer.log_every_n_steps": EVERY, "trainer.callbacks": [],
        "trainer.logger": [{"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                            "init_args": {"save_dir": str(tmp), "name": "tb"}}],
        "alarms": {"min_history": 3}, "throughput": {"window_size": 2},
        "data.init_args.benchmarks": TINY_BENCHMARKS, "trainer.val_check_interval": STEPS,  # KL, noise floor
        "fallback": {"enabled": True, "policy": {"window": 2, "min_events": 1}}})  # logs fallback/tensors
    reads = {"step record": 0, "fallback's own": 0}

    def counted(name, read):
        def gather(*args, **kwargs):
            reads[name] += 1
            return read(*args, **kwargs)
        return gather

    with pytest.MonkeyPatch.context() as patch:  # who reads the scalers' buffers, and how often
        patch.setattr(step_record, "gather_columns", counted("step record", step_record.gather_columns))
        patch.setattr(core_fallback, "gather_columns", counted("fallback's own", core_fallback.gather_columns))
        run = cli.cli_main(["fit", "--config", config])
    run.scaler_reads = reads
    return run, _read(run.trainer.log_dir)


@pytest.mark.slow
def test_one_step_record_per_optimizer_step_serves_every_callback(tensorboard_fit):
    """Saturation, fallback, alarms and the dashboard share the core's one read of the scalers per optimizer step
    (the module's step record): the fallback reads its own counters once, at fit start (its evidence's starting
    point), never per step."""
    run, _ = tensorboard_fit
    assert run.scaler_reads == {"step record": STEPS, "fallback's own": 1}
    saturation = next(c for c in run.trainer.callbacks if isinstance(c, AmaxSaturationCallback))
    assert saturation.last_logged.step == max(s for s in range(STEPS) if (s + 1) % EVERY == 0)  # logged in full


@pytest.mark.slow
def test_the_layout_is_in_the_event_file_and_matches_the_runs_tags(tensorboard_fit):
    run, events = tensorboard_fit
    dashboard = next(c for c in run.trainer.callbacks if isinstance(c, TensorBoardDashboard))
    assert dashboard.written_to == [run.trainer.log_dir]
    layout = _layout(events)
    assert list(layout) == ["saturation", "saturation forecast", "numeric health", "what-if headroom (max_val)",
                            "what-if estimators", "training", "forgetting", "memory", PER_TENSOR]
    written = layout_for(run.trainer)
    assert layout == {category: {title: chart[1] for title, chart in charts.items()} for category, charts in written.items()}
    scalars = events.Tags()["scalars"]
    for category in WRITTEN_HERE:
        for title, patterns in layout[category].items():
            matched = [t for t in scalars if any(re.match(p, t) for p in patterns)]
            assert matched, f"{category} / {title}: no tag matches {patterns}"
    assert any(re.match(r"sat/.*clipped_frac", t) and t != "sat/clipped_frac" for t in scalars)  # per layer too


@pytest.mark.slow
def test_memory_scalars_equal_the_bytes_counted_independently(tensorboard_fit):
    run, events = tensorboard_fit
    module, optimizer = run.model, run.trainer.optimizers[0]
    params = independent_parameter_bytes(module)
    steps = [s for s in range(STEPS) if (s + 1) % EVERY == 0]  # logged at the step they describe
    values = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in (PARAMS_MB, GRADS_MB, OPTIMIZER_MB, RSS_MB)}
    assert all(sorted(v) == steps for v in values.values()), values
    # AdamW holds two moments of each parameter's shape and dtype, and a step count per parameter
    step_bytes = sum(s["step"].numel() * s["step"].element_size() for s in optimizer.state.values())
    assert len(optimizer.state) == sum(1 for p in module.parameters() if p.requires_grad)
    for step in steps:
        assert values[PARAMS_MB][step] * MIB == pytest.approx(params, rel=1e-6)  # TensorBoard keeps float32
        assert values[GRADS_MB][step] == pytest.approx(values[PARAMS_MB][step], rel=1e-6)  # every parameter trains
        assert values[OPTIMIZER_MB][step] * MIB == pytest.approx(2 * params + step_bytes, rel=1e-6)
        persistent = values[PARAMS_MB][step] + values[GRADS_MB][step] + values[OPTIMIZER_MB][step]
        assert values[RSS_MB][step] > persistent > 0  # the process holds them and more
    assert WARMUP < STEPS  # the quantized steps are among the measured ones


def test_the_layout_written_to_a_tensorboard_logger_reads_back(tmp_path):
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    dashboard = TensorBoardDashboard()
    dashboard.on_fit_start(SimpleNamespace(is_global_zero=True, loggers=[logger]), None)  # no callbacks to judge by
    assert dashboard.written_to == [logger.log_dir]
    layout = _layout(_read(logger.log_dir))
    assert layout == {category: {title: chart[1] for title, chart in charts.items()} for category, charts in LAYOUT.items()}
    assert layout["memory"]["breakdown (MiB)"] == [re.escape(t) + "$" for t in (PARAMS_MB, GRADS_MB, OPTIMIZER_MB,
                                                                                   "mem/activations_peak_mb")]


def test_the_dashboard_is_a_no_op_without_tensorboard(tmp_path):
    csv_only = SimpleNamespace(is_global_zero=True, loggers=[CSVLogger(str(tmp_path))])
    dashboard = TensorBoardDashboard()
    dashboard.on_fit_start(csv_only, None)
    assert dashboard.written_to == [] and not any(tmp_path.rglob("events.out.tfevents*"))
    off = SimpleNamespace(is_global_zero=True, loggers=[TensorBoardLogger(str(tmp_path), name="tb")])
    TensorBoardDashboard(enabled=False).on_fit_start(off, None)
    assert not any(tmp_path.rglob("events.out.tfevents*"))


def test_sharded_tensors_count_their_local_shard():
    """A DTensor (FSDP2's parameters, gradients and moments) counts the bytes of its local shard, not of the
    global tensor it stands for."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    with tempfile.TemporaryDirectory() as store:
        dist.init_process_group("gloo", init_method=f"file://{store}/pg", rank=0, world_size=1)
        try:
            mesh = init_device_mesh("cpu", (1,))
            local = torch.zeros(4, 8)
            # as one of 2 ranks would hold it: half of an (8, 8) float32 tensor
            sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size([8, 8]),
                                         stride=(8, 1))
            assert sharded.numel() == 64
            assert tensor_bytes([sharded]) == 4 * 8 * 4
            assert tensor_bytes([sharded, sharded, torch.zeros(3, dtype=torch.bfloat16)]) == 4 * 8 * 4 + 3 * 2
        finally:
            dist.destroy_process_group()


def test_memory_breakdown_of_one_optimizer_step():
    """A linear layer and AdamW through the monitor's hooks (CPU): parameters, gradients, the two moments."""
    layer = torch.nn.Linear(16, 8)
    optimizer = torch.optim.AdamW(layer.parameters())
    module = SimpleNamespace(parameters=layer.parameters, device=torch.device("cpu"))
    logged = []
    logger = SimpleNamespace(log_metrics=lambda metrics, step: logged.append((step, metrics)))
    trainer = SimpleNamespace(global_step=0, log_every_n_steps=1, loggers=[logger], is_global_zero=True,
                              optimizers=[optimizer])
    monitor = MemoryMonitor()
    monitor.on_train_start(trainer, module)
    layer(torch.randn(4, 16)).sum().backward()
    monitor.on_before_optimizer_step(trainer, module, optimizer)
    optimizer.step()
    trainer.global_step = 1
    monitor.on_train_batch_end(trainer, module, None, None, 0)
    params = (16 * 8 + 8) * 4
    [(step, metrics)] = logged
    assert step == 0 and metrics[PARAMS_MB] * MIB == params and metrics[GRADS_MB] * MIB == params
    assert metrics[OPTIMIZER_MB] * MIB == 2 * params + 2 * optimizer.state[layer.bias]["step"].element_size()
    assert metrics[RSS_MB] > 0


def test_memory_monitor_is_off_when_disabled():
    monitor = MemoryMonitor(enabled=False)
    trainer = SimpleNamespace(global_step=2, log_every_n_steps=1, loggers=[], is_global_zero=True)
    monitor.on_train_batch_end(trainer, None, None, None, 0)
    assert monitor.last == {}


def _get(url: str):
    import json
    import urllib.request

    with urllib.request.urlopen(url, timeout=60) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def tensorboard_server(tensorboard_fit):
    """TensorBoard itself, serving the fit's log directory on a free port of this machine."""
    from tensorboard import program

    run, _ = tensorboard_fit
    board = program.TensorBoard()
    board.configure(argv=[None, "--logdir", run.trainer.log_dir, "--host", "127.0.0.1", "--port", "0",
                          "--load_fast", "false", "--reload_interval", "0"])
    return run, board.launch()


@pytest.mark.slow
def test_tensorboard_shows_a_short_runs_dashboard_as_a_person_reads_it(tensorboard_server):
    """Through TensorBoard's HTTP API: every chart of the layout has a series (no empty chart), the model-wide charts
    hold a few lines each while the per-tensor detail holds every tensor, every logging step has its heatmaps, and the
    noise floor sits at the step of the KL it is the floor of."""
    run, url = tensorboard_server
    layout = _get(f"{url}data/plugin/custom_scalars/layout")
    [(name, tags)] = _get(f"{url}data/plugin/scalars/tags").items()
    charts, bands = {}, {}
    for category in layout["category"]:
        for chart in category["chart"]:
            key = (category["title"], chart["title"])
            if "margin" in chart:  # a value with its interval as a band: exact tags
                bands[key] = [tag for series in chart["margin"]["series"]
                              for tag in (series["value"], series["lower"], series["upper"])]
            else:
                charts[key] = chart["multiline"]["tag"]
    assert len(charts) >= 20 and len(bands) >= 3  # the KL, and each benchmark task's measures
    assert not [key for key, band in bands.items() if not set(band) <= set(tags)], bands
    shown = {key: [t for t in tags if any(re.match(p, t) for p in patterns)] for key, patterns in charts.items()}
    empty = [key for key, matched in shown.items() if not matched]
    assert not empty, f"charts with nothing to show: {empty}"
    tensors = [t for t in tags if re.match(r"sat/[^/]*\.[^/]*/clipped_frac$", t)]
    assert len(tensors) >= 6  # the tiny model's quantized inputs and weights
    for (category, title), matched in shown.items():
        if category != PER_TENSOR and not title.startswith(("mean estimated SQNR", "clipped under", "saturation events under", "learning")):
            assert len(matched) <= 5, f"{category} / {title}: {len(matched)} lines"
    assert len(shown[(PER_TENSOR, "clipped fraction")]) == len(tensors)
    # the features this run has off are not in the layout
    assert {title for (_, title) in charts} >= {"tensors fallen back (automatic fallback)"}
    # a picture per logging step: the SQNR and clipped-fraction heatmaps
    images = _get(f"{url}data/plugin/images/tags")[name]
    logged = sorted(s for s in range(STEPS) if (s + 1) % EVERY == 0)
    quantized = [s for s in logged if s >= WARMUP]  # the warmup quantizes nothing: no picture
    assert quantized and len(quantized) < len(logged)
    for tag, steps in (("dashboard/clipped_frac", quantized), ("dashboard/sqnr_db", quantized)):
        assert tag in images
        series = _get(f"{url}data/plugin/images/images?run={name}&tag={tag}&sample=0")
        assert sorted(e["step"] for e in series) == steps, tag
    # every series at the step it describes: the noise floor beside its KL
    def steps_of(tag):
        return [e[1] for e in _get(f"{url}data/plugin/scalars/scalars?run={name}&tag={tag}")]

    assert steps_of("noise_floor/kl") == steps_of("forget/kl")[-1:]
    assert steps_of("forget/generation_kl") == steps_of("forget/kl")  # generation drift beside it, every validation


def test_the_layout_leaves_out_the_charts_of_features_a_run_has_off():
    from callbacks import AmaxSaturationCallback
    from callbacks.fallback import FallbackCallback

    def trainer(*callbacks):
        return SimpleNamespace(callbacks=list(callbacks), datamodule=None)

    full = layout_for(trainer(AmaxSaturationCallback(), FallbackCallback(enabled=True), MemoryMonitor()))
    assert {"saturation", "numeric health", "what-if headroom (max_val)", "memory", PER_TENSOR} <= set(full)
    assert "tensors fallen back (automatic fallback)" in full["saturation"]
    assert "forgetting" not in full  # no benchmarks, no noise floor: nothing to show
    off = layout_for(trainer(AmaxSaturationCallback(health=False, forecast=False, per_layer=False),
                             FallbackCallback(enabled=False), MemoryMonitor(enabled=False)))
    assert set(off) == {"saturation", "what-if estimators", "training"}
    assert "tensors fallen back (automatic fallback)" not in off["saturation"]
    assert set(layout_for(trainer())) == {"training"}  # no saturation callback: only the training charts
