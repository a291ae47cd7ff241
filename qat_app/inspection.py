"""``python main.py inspect``: which layers lose the most in HiF8, and what to keep in high precision.

Every quantized matmul computes its output in high precision and in HiF8 on the same input (the high-precision
model's, so errors do not compound); the layers are ranked by output SQNR, worst first, beside the whole model's
logits SQNR and KL. The model, the data and ``--ckpt_path`` are read as ``main.py validate`` reads them; nothing is
trained and nothing is written but ``--out``. Scales come from the checkpoint's histories or, without one, from a
calibration (``--calibration delayed|current``). The suggestion
(:func:`~qat_app.hif8.layer_error.suggest_high_precision_layers`): the smallest ``high_precision_layers`` whose
quantized blocks hold no layer below ``--min_sqnr`` dB, or a ``module_pattern`` that leaves out exactly those.

See ``docs/diagnostics/inspect.md`` for the command, its options and the output files.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import logging
import math
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from .cli_errors import ProgramParser
from .errors import ConfigError, QATError

log = logging.getLogger("qat_app.inspect")

CSV_FILE, JSON_FILE = "layer_sqnr.csv", "layer_sqnr.json"
DEFAULT_FLOOR_DB = 20.0
METHOD = ("each quantized matmul's HiF8 output against its high-precision output on the same input (the "
          "high-precision model's): the errors are each layer's own, they do not compound")
CALIBRATED = ("delayed, calibrated on {n} other batches (training-mode forwards with quantization off, one scaler "
              "step per batch, as the BF16 warmup)")


class InspectError(ConfigError):
    """Bad input to ``inspect``: the message names the option, field or file."""


@dataclass
class Inspection:
    """What ``inspect`` measured and suggests (rendered by :func:`render`, written by :func:`write_tables`)."""

    model: str
    checkpoint: str | None
    scales: str
    text: str
    batches: int
    tokens: int
    precision: str  # and device, and the operands quantized
    floor_db: float
    num_blocks: int
    measured_k: int
    configured_k: int
    layers: list = field(default_factory=list)  # LayerError, ranked worst first
    end_to_end: object = None  # EndToEnd
    floor: object = None  # qat_app.eval.noise_floor.NoiseFloor of the quantized forward on the same text
    suggested_k: int | None = None
    excluded: list[str] = field(default_factory=list)  # layers below the floor at the measured layout
    suggested_pattern: str | None = None
    pattern_note: str = ""

    @property
    def rule(self) -> str:
        return (f"the smallest high_precision_layers k >= {self.measured_k} whose quantized blocks (all but the first "
                f"ceil(k/2) and the last floor(k/2) of {self.num_blocks}) hold no layer below {self.floor_db:g} dB")

    def rows(self) -> list[dict]:
        return [{"rank": i + 1, "layer": e.name, "block": e.block, "sqnr_db": e.sqnr_db, "cosine": e.cosine,
                 "elements": e.elements, "below_floor": e.sqnr_db < self.floor_db}
                for i, e in enumerate(self.layers)]


def inspect_parser(prog: str) -> argparse.ArgumentParser:
    parser = ProgramParser(
        prog=prog,
        description="Per quantized layer: the SQNR (dB) and cosine of its HiF8 output against high precision on the "
                    "same input (the high-precision model's: errors do not compound), worst first, with a suggested "
                    "high_precision_layers or module_pattern. Without --ckpt_path every block is measured "
                    "(high_precision_layers 0) after a calibration; with one, its layout and scales.",
        epilog="Every other flag is `main.py validate`'s: --config FILE (the run's model and data sections), "
               "--ckpt_path FILE|DIR|last (a QAT checkpoint, a file or a sharded FSDP2 directory: its scales), "
               "--model.*, --data.*, --trainer.precision ... "
               "Text from a local file: --data.init_args.data_files FILE --data.init_args.dataset null.")
    parser.add_argument("--batches", type=int, default=4, help="batches of text to compare on (default 4)")
    parser.add_argument("--split", choices=("auto", "val", "train"), default="auto",
                        help="val: the held-out documents (data.val_documents); train: the start of the training "
                             "stream; auto (default): val when the data holds documents out, else train")
    parser.add_argument("--min_sqnr", type=float, default=DEFAULT_FLOOR_DB, metavar="DB",
                        help="the suggestion's floor: the smallest high_precision_layers k whose quantized blocks (all "
                             "but the first ceil(k/2), last floor(k/2)) hold no layer below it (default "
                             f"{DEFAULT_FLOOR_DB:g} dB: noise at 1%% of the signal power)")
    parser.add_argument("--calibration", choices=("delayed", "current"), default=None,
                        help="scales of a model without --ckpt_path: delayed (default; calibrated on other batches, "
                             "as the BF16 warmup) or current (each tensor's own amax)")
    parser.add_argument("--calibration_batches", type=int, default=None, metavar="N",
                        help="batches the delayed calibration observes, taken before the compared ones (default: --batches)")
    parser.add_argument("--top", type=int, default=None, metavar="N", help="print only the N worst layers (files hold all)")
    parser.add_argument("--out", default=None, metavar="DIR", help=f"also write DIR/{CSV_FILE} and DIR/{JSON_FILE}")
    return parser


def check_options(options: argparse.Namespace) -> None:
    for flag in ("batches", "calibration_batches", "top"):
        value = getattr(options, flag)
        if value is not None and value < 1:
            raise InspectError(f"--{flag}: must be >= 1, got {value}")
    if not math.isfinite(options.min_sqnr):
        raise InspectError(f"--min_sqnr: must be a finite number of dB, got {options.min_sqnr}")
    if options.out is not None and Path(options.out).exists() and not Path(options.out).is_dir():
        raise InspectError(f"--out {options.out}: exists and is not a directory")


def main(argv: list[str] | None = None, prog: str = "python main.py inspect") -> int:
    """CLI; returns the exit status (2, with one ``error: ...`` line, for bad input)."""
    from .cli import configure_logging

    options, lightning_args = inspect_parser(prog).parse_known_args(argv)
    configure_logging()
    try:
        check_options(options)
        inspection = run_inspection(options, lightning_args)
    except (QATError, FileNotFoundError) as err:
        if os.environ.get("QAT_APP_TRACEBACK"):
            raise
        print(f"error: {err}", file=sys.stderr)
        return getattr(err, "exit_code", 2)
    print(render(inspection, options.top))
    if options.out is not None:
        print("wrote " + ", ".join(write_tables(inspection, options.out)))
    return 0


def run_inspection(options: argparse.Namespace, lightning_args: list[str]) -> Inspection:
    """Parse and build as ``main.py validate`` would (LightningCLI), then measure instead of validating."""
    from .cli import cli_kwargs

    with warnings.catch_warnings():  # the args are ours, built from the command line, not a second command line
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        cli = _inspect_cli(options)(**cli_kwargs(), args=["validate", *lightning_args], run=True)
    return cli.inspection


def _inspect_cli(options: argparse.Namespace):
    """QATCLI whose ``validate`` subcommand measures: LightningCLI calls the CLI's own method of a subcommand's
    name instead of the trainer's."""
    from .checkpoint import is_checkpoint_file_arg
    from .cli import QATCLI

    class InspectCLI(QATCLI):
        def before_instantiate_classes(self) -> None:
            super().before_instantiate_classes()
            quant, ckpt_path = self.config.validate.model.quant, self.config.validate.get("ckpt_path")
            self.configured_k = quant.high_precision_layers
            if not ckpt_path:  # measure every block, so any k can be suggested
                quant.high_precision_layers = 0
                return
            if options.calibration or options.calibration_batches:
                raise InspectError("--calibration / --calibration_batches: a --ckpt_path checkpoint brings its own "
                                   "scales (from its amax histories); leave them out")
            if is_checkpoint_file_arg(ckpt_path):  # refused before the model is built (`last`: once resolved)
                _checkpoint_state(ckpt_path, self.config.validate.get("weights_only"), check_only=True)

        def before_validate(self) -> None:
            # the checkpoint check of `validate` (resolves `last`); not its refusal of a model without history:
            # inspect calibrates one
            asked = self.config_init.validate.get("ckpt_path")
            self._resolve_ckpt_path(need_training_state=False)
            if asked and not self.config_init.validate.get("ckpt_path"):
                raise InspectError(f"--ckpt_path {asked}: no checkpoint of this run was found; give a checkpoint file")

        def validate(self, model, datamodule=None, ckpt_path=None, weights_only=None, **_) -> None:
            self.inspection = measure(self.trainer, model, datamodule, ckpt_path, weights_only, options,
                                      configured_k=self.configured_k, warmup=self.config.validate.warmup)

    return InspectCLI


def _number(value: float, spec: str) -> str:
    return "inf" if value == math.inf else "-" if math.isnan(value) else format(value, spec)


def render(inspection: Inspection, top: int | None = None) -> str:
    e2e = inspection.end_to_end
    lines = [f"inspect: {len(inspection.layers)} quantized matmuls of {inspection.model}"
             + (f" ({inspection.checkpoint})" if inspection.checkpoint else ""),
             f"text:    {inspection.batches} batches, {inspection.tokens} tokens: {inspection.text}",
             f"run:     {inspection.precision}", f"scales:  {inspection.scales}", f"method:  {METHOD}", "",
             f"{'rank':>4}  {'SQNR dB':>8}  {'cosine':>8}  {'block':>5}  layer"]
    shown = inspection.layers[:top] if top else inspection.layers
    for row, e in zip(inspection.rows(), shown):
        lines.append(f"{row['rank']:>4}  {_number(e.sqnr_db, '8.2f'):>8}  {_number(e.cosine, '8.5f'):>8}  "
                     f"{'-' if e.block is None else e.block:>5}  {e.name}" + ("  < floor" if row["below_floor"] else ""))
    if len(shown) < len(inspection.layers):
        lines.append(f"      ... {len(inspection.layers) - len(shown)} more (--top)")
    lines += ["", f"end to end (errors compound): logits SQNR {_number(e2e.logits_sqnr_db, '.2f')} dB, "
                  f"KL(high precision || HiF8) {_number(e2e.kl_per_token, '.3g')} nats/token over {e2e.tokens} tokens",
              *([f"         {inspection.floor.describe()}: the end-to-end KL is "
                 f"{_floor_multiple(e2e.kl_per_token, inspection.floor)} of it"] if inspection.floor is not None else []),
              f"rule:    {inspection.rule}"]
    configured = f" (configured: {inspection.configured_k})"
    if inspection.suggested_k is None:
        lines.append("suggested high_precision_layers: none (a layer outside the decoder blocks is below the floor)")
    else:
        lines.append(f"suggested: --model.quant.high_precision_layers {inspection.suggested_k}{configured}")
    if inspection.excluded:
        lines.append(f"or keep high_precision_layers {inspection.measured_k} and leave out the {len(inspection.excluded)} "
                     f"layers below the floor: " + (f"--model.quant.module_pattern '{inspection.suggested_pattern}'"
                                                    if inspection.suggested_pattern else inspection.pattern_note))
    return "\n".join(lines)


def _floor_multiple(kl: float, floor) -> str:
    if not floor.quantized or floor.kl.difference <= 0:
        return "not comparable to a floor"
    return f"{kl / floor.kl.difference:.1f}x"


def _json_number(value: float) -> float | None:
    return value if math.isfinite(value) else None  # strict JSON: inf (an exact layer) and nan become null


def write_tables(inspection: Inspection, out_dir: str) -> list[str]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = inspection.rows()
    with open(out / CSV_FILE, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["rank"])
        writer.writeheader()
        writer.writerows(rows)
    e2e = inspection.end_to_end
    document = {
        "model": inspection.model, "checkpoint": inspection.checkpoint, "scales": inspection.scales,
        "text": inspection.text, "batches": inspection.batches, "tokens": inspection.tokens,
        "precision": inspection.precision, "method": METHOD, "floor_db": inspection.floor_db, "rule": inspection.rule,
        "num_blocks": inspection.num_blocks, "measured_high_precision_layers": inspection.measured_k,
        "configured_high_precision_layers": inspection.configured_k,
        "suggested_high_precision_layers": inspection.suggested_k,
        "below_floor_at_measured_layout": inspection.excluded, "suggested_module_pattern": inspection.suggested_pattern,
        "end_to_end": {"logits_sqnr_db": _json_number(e2e.logits_sqnr_db), "kl_per_token": _json_number(e2e.kl_per_token),
                       "tokens": e2e.tokens,
                       "noise_floor": None if inspection.floor is None else inspection.floor.to_dict()},
        "layers": [{**row, "sqnr_db": _json_number(row["sqnr_db"]), "cosine": _json_number(row["cosine"])} for row in rows],
    }
    (out / JSON_FILE).write_text(json.dumps(document, indent=1))
    return [str(out / CSV_FILE), str(out / JSON_FILE)]


def text_batches(datamodule, split: str, count: int) -> tuple[list, str]:
    """``count`` batches of token ids from the data's held-out documents or training stream -> (batches, what)."""
    if not hasattr(datamodule, "make_val_dataloader"):
        raise InspectError(f"data: inspect reads token blocks from qat_app.data.pretrain.PretrainDataModule, not "
                           f"{type(datamodule).__name__}")
    if split == "auto":
        split = "val" if datamodule.val_documents > 0 else "train"
    if split == "val" and datamodule.val_documents == 0:
        raise InspectError("--split val: data.val_documents=0 holds no document out; set --data.init_args.val_documents "
                           "N or use --split train")
    loader = datamodule.make_val_dataloader(0, 1) if split == "val" else datamodule.make_train_dataloader(0, 1)
    batches = [batch["input_ids"] for batch in itertools.islice(loader, count)]
    what = ("held-out text (data.val_documents)" if split == "val" else "the training stream's first blocks") + \
        f" of {datamodule.source.name}"
    if not batches:
        raise InspectError(f"no batches available: {what} gives none")
    return batches, what


def _checkpoint_state(ckpt_path, weights_only: bool | None, check_only: bool = False) -> dict:
    """The checkpoint's state dict (a file or a sharded FSDP2 directory; ``check_only``: its step counters only),
    refused when it holds no scales: no quantized layer, or no scaler with a recorded step (``steps_recorded == 0``
    everywhere)."""
    from .checkpoint import read_checkpoint

    select = (lambda key: key.endswith(".steps_recorded")) if check_only else None
    state = read_checkpoint(str(ckpt_path), weights_only, select=select)["state_dict"]
    recorded = [int(value) for key, value in state.items() if key.endswith(".steps_recorded")]
    if not recorded:
        raise InspectError(f"--ckpt_path {ckpt_path}: no quantized layer in it (a run with model.quant.enabled=false): "
                           "nothing to compare")
    if not any(recorded):
        raise InspectError(
            f"--ckpt_path {ckpt_path}: no amax history (steps_recorded == 0 in all {len(recorded)} scalers): it was "
            "saved before the first optimizer step, so it holds no scales; give a later checkpoint, or leave "
            "--ckpt_path out to inspect the model calibrated")
    return state


def _module_pattern_suggestion(model, selection, measured_k: int, below: list[str]) -> tuple[str | None, str]:
    """A module_pattern that keeps the measured layout but leaves out exactly ``below``, checked against the model
    -> (pattern or None, why none)."""
    from .hif8.errors import SelectionError
    from .hif8.layer_error import exclusion_pattern
    from .hif8.linear import HiF8Linear
    from .hif8.patch import quantized_linears, select_modules
    from .hif8.recipe import LayerSelection

    dense = {name for name, layer in quantized_linears(model) if isinstance(layer, HiF8Linear)}
    if not set(below) <= dense:
        return None, ("MoE expert projections are among them, and experts are converted per experts module, not "
                      "one by one: use high_precision_layers")
    pattern = exclusion_pattern(selection.module_pattern, below)
    try:
        chosen, _, _ = select_modules(model, LayerSelection(module_pattern=pattern, block_pattern=selection.block_pattern,
                                                            high_precision_layers=measured_k))
    except SelectionError:
        return None, "every quantized linear is below the floor: lower --min_sqnr, or quant.enabled=false"
    if {name for name, _ in chosen} != dense - set(below):
        return None, "no module_pattern derived from the configured one leaves out exactly these"
    return pattern, ""


def _compare(model, compared: list, forward, operands: dict, block_pattern: str):
    """Every quantized matmul's output against high precision on each batch, the end-to-end error, and the
    quantized forward's noise floor on the same batches -> (errors by layer, totals, floor)."""
    import torch

    from .eval.noise_floor import noise_floor
    from .hif8.layer_error import EndToEnd, end_to_end, layer_comparison
    from .hif8.patch import set_quantization

    errors, totals = {}, EndToEnd()
    with torch.no_grad():
        for input_ids in compared:
            end_to_end(model, input_ids, forward, totals, **operands)
            with layer_comparison(model, errors, block_pattern=block_pattern, **operands):
                forward(input_ids)
        set_quantization(model, weights=operands["quantize_weight"], activations=operands["quantize_input"])
        floor = noise_floor(model, compared, forward=forward, quantized=any(operands.values()))
        set_quantization(model, weights=False, activations=False)
    return errors, totals, floor


def measure(trainer, module, datamodule, ckpt_path, weights_only, options, configured_k: int, warmup) -> Inspection:
    """Load the scales (checkpoint) or calibrate, compare every quantized matmul on ``options.batches`` batches,
    rank, suggest."""
    from .hif8.layer_error import calibrate, suggest_high_precision_layers
    from .hif8.patch import count_blocks, quantized_linears
    from .hif8.scaling import all_scalers

    model, selection = module.model, module.quant.selection
    if not quantized_linears(model):
        raise InspectError("model.quant.enabled=false" + (" in the checkpoint" if ckpt_path else "")
                           + ": no layer is quantized, there is nothing to compare")
    if ckpt_path:  # the checkpoint's weights and amax histories (:func:`_checkpoint_state`'s checks)
        module.load_state_dict(_checkpoint_state(ckpt_path, weights_only))
    recipe = quantized_linears(model)[0][1].recipe
    current = recipe.amax_algo == "current" or (not ckpt_path and options.calibration == "current")
    calibration_batches = 0 if ckpt_path or current else (options.calibration_batches or options.batches)
    batches, what = text_batches(datamodule, options.split, calibration_batches + options.batches)
    if len(batches) <= calibration_batches:
        raise InspectError(f"no batches available to compare: {what} gives {len(batches)} batches, all taken by the "
                           f"{calibration_batches} of the calibration; lower --calibration_batches or hold out more text")

    plugin, device = trainer.precision_plugin, trainer.strategy.root_device
    module = plugin.convert_module(module).to(device)
    model = module.model
    batches = [ids.to(device) for ids in batches]

    def forward(input_ids):
        with plugin.forward_context():
            return model(input_ids=input_ids).logits

    if ckpt_path:
        scales = f"delayed, from the checkpoint's amax histories ({recipe.amax_algo}, H={recipe.history_len})"
    elif current:
        scales = "current: each tensor scaled by its own amax" + (
            " (the recipe's amax_algo)" if recipe.amax_algo == "current" else "")
    else:
        scales = CALIBRATED.format(n=calibrate(model, batches[:calibration_batches], forward))
    without = sum(1 for s in all_scalers(model) if s.algo != "current" and not s.has_history)
    if without and not current:
        scales += f"; {without} scalers without history (never reached) use current scaling"

    operands = dict(quantize_input=bool(warmup.quantize_activations), quantize_weight=bool(warmup.quantize_weights))
    compared = batches[calibration_batches:]
    module.eval()
    errors, totals, floor = _compare(model, compared, forward, operands, selection.block_pattern)
    ranked = sorted(errors.values(), key=lambda e: (math.isnan(e.sqnr_db), e.sqnr_db))
    num_blocks, measured_k = count_blocks(model, selection.block_pattern), selection.high_precision_layers
    below = [e.name for e in ranked if e.sqnr_db < options.min_sqnr]
    pattern, note = _module_pattern_suggestion(model, selection, measured_k, below) if below else (None, "")
    operand_names = "+".join(name for name, on in (("input", operands["quantize_input"]),
                                                   ("weight", operands["quantize_weight"])) if on)
    return Inspection(
        model=str(module.hparams.get("model_name")), checkpoint=str(ckpt_path) if ckpt_path else None, scales=scales,
        text=f"{what}, {' x '.join(map(str, compared[0].shape))} tokens a batch", batches=len(compared),
        tokens=sum(ids.numel() for ids in compared), precision=f"trainer.precision {trainer.precision}, {device}, "
        f"quantized: {operand_names or 'nothing'}", floor_db=options.min_sqnr, num_blocks=num_blocks,
        measured_k=measured_k, configured_k=configured_k, layers=ranked, end_to_end=totals, floor=floor,
        suggested_k=suggest_high_precision_layers(ranked, num_blocks, options.min_sqnr, measured_k),
        excluded=below, suggested_pattern=pattern, pattern_note=note)
