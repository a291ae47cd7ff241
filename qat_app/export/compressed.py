"""The FP8 serving export: a ``compressed-tensors`` checkpoint that vLLM and transformers load, holding the trained
HiF8 weights exactly (:func:`export_compressed_tensors`); for a CPU server, int8 instead (``serve_target="cpu"``,
:mod:`.int8`).

Each quantized weight is written as the E4M3 values ``16 v`` of its HiF8 grid values ``v``, with per-output-channel
scales ``1 / (16 s)``; activations follow the serve target (:data:`SERVE_TARGETS`). Everything else stays in
``dtype`` and is named in the ``ignore`` list. Contract: above E4M3's floor (``|v| >= 2^-12``) every written weight,
read back and dequantized by compressed-tensors, equals the QAT model's fake-quantized weight within one float32
rounding of the scale (bit for bit with power-of-two scales); this is checked before the export is renamed into
place. The elements below the floor are counted per tensor in ``fp8_export.json``.

See ``docs/serving.md`` for the serve targets, what is ignored and why, and the report file.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
from torch import nn

from ..hif8.experts import HiF8Experts
from ..hif8.fake_quant import dequantize_codes
from ..hif8.fp8_gemm import E4M3_MAX, e4m3_decode_scale, grid_to_e4m3, shift_for
from ..hif8.linear import HiF8Linear
from ..hif8.operand import Operand
from ..hif8.patch import dequantize_model, quantized_linears
from .hf import set_quantized_weights
from .layout import ExportError, checkpoint_bytes, dtype_name
from .int8 import int8_summary, int8_totals, int8_weight
from .serve_targets import DEFAULT_SERVE_TARGET, SERVE_TARGETS, ServeTarget
from .source import ExportSource, WeightCodes
from .writer import why_dense
from .writing import ExportFormat, write_export

log = logging.getLogger("qat_app.export")

REPORT_FILE = "fp8_export.json"
REPORT_FORMAT = "qat_app/fp8-compressed-tensors"
FORMAT_NAME = "compressed-tensors"
SERVABLE_FORMATS = ("hif8", "e4m3")  # formats whose grid maps onto E4M3 by a power of two
# vLLM fuses these siblings into one GEMM (its packed_modules_mapping): they must share one scheme
FUSED_SHARDS = (("gate_proj", "up_proj"), ("q_proj", "k_proj", "v_proj"))
STATIC, DYNAMIC, WEIGHT_ONLY, INT8 = "w8a8_static", "w8a8_dynamic", "w8a16", "int8_w8a8_dynamic"
SCHEMES = (STATIC, DYNAMIC, WEIGHT_ONLY, INT8)
EXPERTS_WHY = ("transformers 5 stores them fused ([E, 2I, H]); compressed-tensors has no FP8 compressor for that "
               "layout and vLLM's fused-MoE loader reads per-expert names")
# one float32 rounding of the scale, one of the product, one of the QAT reference: < 2^-22 relative
DEQUANT_TOLERANCE = 2.0**-22


def _args(dynamic: bool | None, strategy: str, number: str = "float"):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=8, type=number, strategy=strategy, symmetric=True, dynamic=dynamic)


def weight_args(scheme: str = DYNAMIC):
    """The weights of a scheme, one scale per output channel: E4M3 (each row carries its tensor's HiF8 scale), or
    int8 (:mod:`.int8`)."""
    return _args(False, "channel", "int" if scheme == INT8 else "float")


def activation_args(scheme: str):
    """The input activations of a scheme: static per-tensor or dynamic per-token E4M3 (vLLM serves every dynamic
    FP8 input per token), dynamic per-token int8; None for weight-only."""
    return {STATIC: _args(False, "tensor"), DYNAMIC: _args(True, "token"), WEIGHT_ONLY: None,
            INT8: _args(True, "token", "int")}[scheme]


def check_serve_target(target: str) -> ServeTarget:
    if target not in SERVE_TARGETS:
        raise ExportError(f"--serve_target {target!r}: one of {', '.join(SERVE_TARGETS)}")
    return SERVE_TARGETS[target]


def _scheme_of(name: str, layer: HiF8Linear, target: ServeTarget) -> tuple[str | None, str]:
    """(scheme, why) of one quantized linear; scheme None: kept in high precision (ignored), for ``why``."""
    if layer.source_type != "linear":
        return None, f"a {layer.source_type} layer: the compressed-tensors format quantizes nn.Linear"
    if not layer.quantizes(Operand.WEIGHT):
        return None, why_dense(layer)
    if not layer.quantizes(Operand.INPUT):
        decision = layer.fallback.get(Operand.INPUT)
        why = (f"its input fell back to high precision at step {decision.step}" if decision
               else "input quantization is off")
        if not target.weight_only_kernel:
            return None, (f"{why}; vLLM's CPU platform has no 8-bit weight-only (W8A16) kernel, so --serve_target "
                          f"{target.name} keeps the layer dense (--serve_target cuda writes it W8A16)")
        return WEIGHT_ONLY, f"{why}: FP8 weights, BF16 activations"
    scaler = layer.input_scaler
    if target.int8:
        return INT8, f"--serve_target {target.name}: int8 weights and dynamic per-token int8 inputs"
    if scaler.algo == "current" or target.dynamic_inputs:
        return DYNAMIC, f"--serve_target {target.name}: dynamic per-token activation scales"
    if not scaler.has_history:
        raise ExportError(
            f"{name}: its input scaler has no amax history (steps_recorded 0): there is no trained activation scale "
            "to export; export a checkpoint saved after the first QAT step (--ckpt_path)")
    return STATIC, "static activation scale from the trained amax history"


def _fused_siblings(name: str) -> list[str]:
    parent, _, leaf = name.rpartition(".")
    for group in FUSED_SHARDS:
        if leaf in group:
            return [f"{parent}.{shard}" for shard in group]
    return [name]


def plan_layers(model: nn.Module, target: str = DEFAULT_SERVE_TARGET) -> tuple[dict[str, str], dict[str, str]]:
    """-> ({layer: scheme} of the layers written in FP8, {layer: why} of the quantized ones kept in high precision),
    for one of :data:`SERVE_TARGETS`.

    Refuses (:class:`ExportError`, naming the setting) a format that does not map onto E4M3 and a static input
    without history."""
    serve = check_serve_target(target)
    layers = {name: layer for name, layer in quantized_linears(model) if isinstance(layer, HiF8Linear)}
    for name, layer in layers.items():
        if layer.recipe.format not in SERVABLE_FORMATS:
            raise ExportError(f"model.quant.format {layer.recipe.format!r} (layer {name}): the FP8 serving export "
                              f"needs a format whose values are E4M3 values up to a power of two: "
                              f"{', '.join(SERVABLE_FORMATS)}")
    schemes, ignored = {}, {}
    for name, layer in layers.items():
        scheme, why = _scheme_of(name, layer, serve)
        if scheme is None:
            ignored[name] = why
        else:
            schemes[name] = scheme
    modules = dict(model.named_modules())
    for name in list(schemes):
        siblings = [s for s in _fused_siblings(name) if s in modules]
        kinds = {s: schemes.get(s) for s in siblings}
        if len(set(kinds.values())) > 1:
            detail = ", ".join(f"{s.rpartition('.')[2]}: {k or 'high precision'}" for s, k in kinds.items())
            for sibling in siblings:
                if schemes.pop(sibling, None) is not None:
                    ignored[sibling] = (f"vLLM fuses {'/'.join(s.rpartition('.')[2] for s in siblings)} into one GEMM "
                                        f"with one scheme, and they differ ({detail})")
    return schemes, ignored


def _linear_names(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def quantization_config(schemes: dict[str, str], ignore: list[str]):
    """The checkpoint's ``quantization_config``, built and validated by compressed-tensors' own models."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    groups = {}
    for kind in SCHEMES:
        targets = sorted(name for name, scheme in schemes.items() if scheme == kind)
        if targets:
            groups[f"group_{len(groups)}"] = QuantizationScheme(targets=targets, weights=weight_args(kind),
                                                                input_activations=activation_args(kind))
    number = "int" if INT8 in schemes.values() else "float"  # one target: one number format
    config = QuantizationConfig(config_groups=groups, format=f"{number}-quantized", quantization_status="compressed",
                                ignore=sorted(ignore))
    return QuantizationConfig.model_validate(config.model_dump())  # what a reader parses back


def _input_scale(layer: HiF8Linear) -> torch.Tensor:
    return e4m3_decode_scale(layer.input_scaler.scale.detach().float().reshape(()), layer.input_scaler.max_val).reshape(1)


def _fp8_weight(name: str, layer: HiF8Linear, weight: WeightCodes) -> tuple[dict[str, torch.Tensor], dict]:
    """One linear's E4M3 weight and per-channel scale from its HiF8 ``weight`` (+ the reference and figures for the
    report and the check)."""
    fmt, max_val = layer.format, layer.weight_scaler.max_val
    codes, scale = weight.codes, weight.scale
    grid = fmt.decode(codes).float()
    e4m3, exact = grid_to_e4m3(grid, max_val)
    decode_scale = e4m3_decode_scale(scale, max_val)
    shift = shift_for(max_val)
    error = (e4m3.float() - grid * shift).abs() * decode_scale  # in weight units; zero above the floor
    below = int((~exact).sum())
    record = {
        "elements": grid.numel(),
        "below_floor": below,
        "max_error_below_floor": float(error.max()) if below else 0.0,
        "max_error_relative_to_range": float(error.max() * scale / max_val) if below else 0.0,
        "hif8_weight_scale": float(scale),
        "weight_scale": float(decode_scale),
    }
    tensors = {
        f"{name}.weight": e4m3.cpu(),
        f"{name}.weight_scale": decode_scale.reshape(1, 1).expand(e4m3.shape[0], 1).contiguous().cpu(),
    }
    reference = dequantize_codes(codes, scale, fmt, torch.float32).cpu()
    return tensors, {"record": record, "exact": exact.cpu(), "reference": reference}


def _equalize_fused_inputs(schemes: dict[str, str], tensors: dict[str, torch.Tensor], records: dict) -> list[dict]:
    """vLLM serves a fused group's static input with the largest of its shards' scales: write that one to each
    (gate and up see the same input, so their scales normally agree already)."""
    changed, seen = [], set()
    for name, scheme in schemes.items():
        siblings = [s for s in _fused_siblings(name) if s in schemes]
        if scheme != STATIC or len(siblings) < 2 or siblings[0] in seen:
            continue
        seen.add(siblings[0])
        scales = {s: tensors[f"{s}.input_scale"] for s in siblings}
        largest = torch.stack(list(scales.values())).amax(0)
        if any(not torch.equal(v, largest) for v in scales.values()):
            changed.append({"layers": siblings, "input_scales": {s: float(v) for s, v in scales.items()},
                            "served": float(largest)})
            for s in siblings:
                tensors[f"{s}.input_scale"] = largest.clone()
                records[s]["input"].update(input_scale=float(largest), served_clip=float(E4M3_MAX * largest))
    return changed


def _check_written(out_dir: Path, checks: dict[str, dict]) -> dict[str, dict]:
    """Read the written weights back and dequantize them with compressed-tensors: above the floor they must equal
    the QAT model's fake-quantized weights within :data:`DEQUANT_TOLERANCE` -> per layer, what was measured."""
    from contextlib import ExitStack

    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from safetensors import safe_open

    measured = {}
    with ExitStack() as stack:  # each file opened once
        files = [stack.enter_context(safe_open(str(path), "pt")) for path in sorted(out_dir.glob("*.safetensors"))]
        where = {key: f for f in files for key in f.keys()}
        for name, check in checks.items():
            keys = (f"{name}.weight", f"{name}.weight_scale")
            missing = [k for k in keys if k not in where]
            if missing:
                raise ExportError(f"{out_dir}: the written checkpoint lacks {missing} (self-check)")
            weight, scale = (where[key].get_tensor(key) for key in keys)
            served = dequantize(weight, scale, args=check["args"], dtype=torch.float32)
            reference, exact = check["reference"], check["exact"]
            diff = (served - reference).abs()[exact]
            relative = diff / reference.abs()[exact].clamp_min(torch.finfo(torch.float32).tiny)
            worst = float(relative.max()) if relative.numel() else 0.0
            if not worst <= DEQUANT_TOLERANCE:
                raise ExportError(f"{name}: the written 8-bit weight dequantizes to {worst:.3g} relative of the QAT "
                                  f"weight above the floor (allowed {DEQUANT_TOLERANCE:.3g}): export refused")
            measured[name] = {"dequantized_max_relative_difference": worst,
                              "bitwise_equal_above_floor": bool(torch.equal(served[exact], reference[exact]))}
    return measured


def _bf16_bytes(model: nn.Module) -> int:
    """What the model's parameters take in BF16 (shared tensors once): the size a BF16 ``save_pretrained`` writes."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * 2
    return total


class ServablePlan(NamedTuple):
    """What a compressed-tensors export writes in 8 bits and what it keeps in the storage dtype."""

    schemes: dict[str, str]  # linear -> its scheme
    ignored: dict[str, str]  # linear -> why it stays in the storage dtype
    experts: list[str]  # MoE experts modules (kept in the storage dtype)


class FP8Layers(NamedTuple):
    """The planned layers' written tensors, their report records and what the written weights are checked with."""

    tensors: dict[str, torch.Tensor]
    records: dict[str, dict]
    checks: dict[str, dict]


def _servable_plan(model: nn.Module, serve_target: str) -> ServablePlan:
    """:func:`plan_layers` and the MoE experts modules (kept in ``dtype``); refuses (saying what to use instead) a
    model of which no layer can be written in FP8 for ``serve_target``."""
    if not quantized_linears(model):
        raise ExportError(f"{type(model).__name__} has no HiF8 layer (model.quant.enabled=false?): nothing to serve "
                          "in FP8; use --format hf")
    schemes, ignored = plan_layers(model, serve_target)
    experts = [name for name, m in model.named_modules() if isinstance(m, HiF8Experts)]
    if not schemes and experts:
        raise ExportError(f"the only quantized modules are MoE experts ({experts[0]} ...), which this format cannot hold in "
                          f"FP8 ({EXPERTS_WHY}); use --format hif8 for their 8-bit weights")
    if not schemes and not any(layer.quantizes(Operand.WEIGHT) for _, layer in quantized_linears(model)):
        raise ExportError("no layer's weight is quantized in this checkpoint (saved inside the BF16 warmup?), so "
                          f"there is nothing to write in FP8: {next(iter(ignored.values()), '')}")
    if not schemes:
        raise ExportError(f"--serve_target {serve_target}: no layer of this checkpoint can be served in FP8 that "
                          f"way: {next(iter(ignored.values()), '')}")
    return ServablePlan(schemes, ignored, experts)


def _fp8_layers(schemes: dict[str, str], modules: dict[str, nn.Module], weights: dict[str, WeightCodes],
                encoding: WeightEncoding) -> FP8Layers:
    """The 8-bit tensors of every planned layer (weight, scale, a static scheme's input scale) from the source's
    ``weights`` in ``encoding``, the report's per-layer records, and what :func:`_check_written` compares the
    written weights with."""
    tensors: dict[str, torch.Tensor] = {}
    records: dict[str, dict] = {}
    checks: dict[str, dict] = {}
    for name, scheme in schemes.items():
        layer = modules[name]
        written, check = encoding.write(name, layer, weights[name])
        check["args"] = weight_args(scheme)
        tensors.update(written)
        checks[name] = check
        records[name] = {"scheme": scheme, **check["record"]}
        if scheme == STATIC:
            scaler = layer.input_scaler
            tensors[f"{name}.input_scale"] = _input_scale(layer)
            records[name]["input"] = {
                "a_hat": float(scaler.a_hat), "hif8_scale": float(scaler.scale),
                "input_scale": float(tensors[f"{name}.input_scale"]),
                "trained_clip": float(scaler.max_val / scaler.scale),  # |x| HiF8 clipped at
                "served_clip": float(E4M3_MAX * tensors[f"{name}.input_scale"]),  # |x| E4M3 clips at
            }
    return FP8Layers(tensors, records, checks)


def _dequantized_copy(source: ExportSource) -> nn.Module:
    """A plain copy of the source's model in its storage dtype (the model is not modified): what is saved around
    the FP8 tensors, every other weight as the QAT forward used it."""
    plain = copy.deepcopy(source.model)
    set_quantized_weights(plain, source.weights)
    dequantize_model(plain)
    plain.to(source.storage_dtype).eval()
    return plain


def _report(*, info: dict, qat_format: str, serve_target: str, storage_dtype: torch.dtype, schemes: dict[str, str],
            records: dict, ignored: dict, equalized: list[dict], sizes: dict[str, int]) -> dict:
    """``fp8_export.json``: the scheme of each FP8 layer and its figures, what is kept in ``dtype`` and why, sizes."""
    return {
        "format": REPORT_FORMAT,
        "version": 1,
        "exported_by": "qat_app.export.export_compressed_tensors",
        "source": info.get("model_name"),
        "qat_format": qat_format,
        "serve_target": {**SERVE_TARGETS[serve_target].described(),
                         "alternatives": {name: target.cost for name, target in SERVE_TARGETS.items()
                                          if name != serve_target}},
        "storage_dtype": dtype_name(storage_dtype),
        "dequantized_tolerance": DEQUANT_TOLERANCE,
        "layers": records,
        "ignored": dict(sorted(ignored.items())),
        "fused_input_scales_equalized": equalized,
        "bytes": sizes,
        **encoding_of(serve_target).totals(schemes, records),
    }


def _fp8_totals(schemes: dict[str, str], records: dict) -> dict:
    return {
        "floor": "E4M3 rounds the grid values below 2^-12 x 16 of a range of 15 (HiF8's denormals and the 1-bit "
                 "tier under them); every value above is written exactly",
        "totals": {
            "fp8_layers": len(schemes),
            "fp8_elements": sum(r["elements"] for r in records.values()),
            "below_floor": sum(r["below_floor"] for r in records.values()),
            "max_error_below_floor": max((r["max_error_below_floor"] for r in records.values()), default=0.0),
            "schemes": {kind: sum(1 for s in schemes.values() if s == kind) for kind in (STATIC, DYNAMIC, WEIGHT_ONLY)},
        },
    }


def fp8_summary(out_dir: str | os.PathLike, report: dict) -> str:
    """One line of what an FP8 export holds (the CLI prints it)."""
    totals, size = report["totals"], report["bytes"]
    kinds = ", ".join(f"{count} {kind}" for kind, count in totals["schemes"].items() if count)
    kept = (f", {len(report['ignored'])} quantized modules kept in {report['storage_dtype']} ({REPORT_FILE} says why)"
            if report["ignored"] else "")
    return (f"wrote {out_dir}: {totals['fp8_layers']} linears in FP8 E4M3 ({kinds}){kept}; {size['weights'] / 2**20:.1f} MiB vs {size['bf16_weights'] / 2**20:.1f} "
            f"MiB in BF16 ({size['weights'] / size['bf16_weights']:.3f}x); {totals['below_floor']} of {totals['fp8_elements']} "
            f"weights below the E4M3 floor (largest error {totals['max_error_below_floor']:.3g}); serve target "
            f"{report.get('serve_target', {}).get('name', 'cuda')}: inputs at "
            f"{report.get('serve_target', {}).get('activations', 'static per-tensor scales')}")


class WeightEncoding(NamedTuple):
    """How the planned layers' weights are written: E4M3, or int8 for a CPU server (:mod:`.int8`); the container
    (compressed-tensors, the plain copy around it, the check of what was written, the report) is shared."""

    label: str  # the log's word
    write: Callable[[str, HiF8Linear, WeightCodes], tuple[dict[str, torch.Tensor], dict]]  # one layer's tensors
    totals: Callable[[dict, dict], dict]  # (schemes, records) -> the report's floor and totals
    summary: Callable[[Any, dict], str]  # (the directory, the report) -> the command line's one line


FP8_WEIGHTS = WeightEncoding("FP8", _fp8_weight, _fp8_totals, fp8_summary)
INT8_WEIGHTS = WeightEncoding("INT8", int8_weight, int8_totals, int8_summary)


def encoding_of(serve_target: str) -> WeightEncoding:
    """How ``serve_target`` wants the weights (the one place the choice is made)."""
    return INT8_WEIGHTS if check_serve_target(serve_target).int8 else FP8_WEIGHTS


def export_compressed_tensors(
    module_or_model,
    out_dir: str | os.PathLike,
    *,
    dtype: str | torch.dtype = "bfloat16",
    compute_dtype: str | torch.dtype | None = None,
    tokenizer=None,
    overwrite: bool = False,
    serve_target: str = DEFAULT_SERVE_TARGET,
) -> dict:
    """Save a HiF8 QAT model (QATModule or patched HF model) as an FP8 compressed-tensors checkpoint; returns the
    report (also written as ``fp8_export.json``).

    Args:
        dtype: dtype of everything kept in high precision (BF16, what vLLM serves with; ``"float32"`` keeps an
            fp32 model's other weights exactly, for measuring the FP8 part alone).
        compute_dtype: the dtype the QAT forward ran the quantized linears in (as :func:`export_hif8`).
        overwrite: replace an earlier export of this kind (never a run directory or another export).
        serve_target: the layout (:data:`SERVE_TARGETS`): ``any`` (FP8, dynamic per-token input scales, what vLLM
            serves on CUDA and, slowly, on the CPU), ``cuda`` (FP8, the trained static input scales; vLLM's CUDA
            kernels) or ``cpu`` (int8 weights and per-token inputs, :mod:`.int8`: what vLLM serves fast on a CPU).
    """
    return write_export(FP8_EXPORT, module_or_model, out_dir, dtype=dtype, compute_dtype=compute_dtype,
                        tokenizer=tokenizer, overwrite=overwrite, serve_target=serve_target)


def _prepare(source: ExportSource, serve_target: str = DEFAULT_SERVE_TARGET):
    """The layers' 8-bit tensors for ``serve_target`` and a plain copy of the rest (refusing a model of which no
    layer can be served that way) -> its ``save``, which checks what it wrote before the rename."""
    model, storage_dtype = source.model, source.storage_dtype
    plan = _servable_plan(model, serve_target)
    schemes, ignored, experts = plan.schemes, plan.ignored, plan.experts
    modules = dict(model.named_modules())
    encoding = encoding_of(serve_target)
    layers = _fp8_layers(schemes, modules, source.weights, encoding)
    tensors, records, checks = layers.tensors, layers.records, layers.checks
    equalized = _equalize_fused_inputs(schemes, tensors, records)

    plain = _dequantized_copy(source)
    for name in experts:
        ignored[name] = f"MoE experts: {EXPERTS_WHY}"
    ignore = sorted(set(_linear_names(plain)) - set(schemes)) + experts
    config = quantization_config(schemes, ignore)
    state = dict(plain.state_dict())
    state.update(tensors)
    plain.config.quantization_config = config.model_dump(mode="json")

    def save(directory: Path) -> dict:
        plain.save_pretrained(str(directory), state_dict=state, safe_serialization=True)
        if source.tokenizer is not None:
            source.tokenizer.save_pretrained(str(directory))
        for name, values in _check_written(directory, checks).items():
            records[name].update(values)
        report = _report(info=source.info, qat_format=next(iter(modules[n] for n in schemes)).recipe.format,
                         serve_target=serve_target, storage_dtype=storage_dtype, schemes=schemes, records=records,
                         ignored=ignored, equalized=equalized,
                         sizes={"weights": checkpoint_bytes(directory), "bf16_weights": _bf16_bytes(plain)})
        (directory / REPORT_FILE).write_text(json.dumps(report, indent=1))
        target = SERVE_TARGETS[serve_target]
        log.info("%s export: %d linears, %d kept in %s", encoding.label, len(schemes), len(ignore),
                 dtype_name(storage_dtype))
        if target.on_cpu is not None:
            log.warning("on a CPU: %s", target.on_cpu)
        return report

    return save


def read_report(out_dir: str | os.PathLike) -> dict[str, Any]:
    """``fp8_export.json`` of an FP8 export directory (:class:`ExportError` / FileNotFoundError naming the file)."""
    path = Path(out_dir) / REPORT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; {out_dir} is not an FP8 export (--format {FORMAT_NAME})")
    try:
        report = json.loads(path.read_text())
    except ValueError as err:
        raise ExportError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(report, dict) or report.get("format") != REPORT_FORMAT:
        raise ExportError(f"{path}: not an FP8 export report")
    return report


def _serve_target_option(args) -> dict:
    return {"serve_target": args.serve_target}


def summary_line(out_dir: str | os.PathLike, report: dict) -> str:
    """One line of what the export holds, in its encoding's words (the CLI prints it)."""
    return encoding_of(report.get("serve_target", {}).get("name", "cuda")).summary(out_dir, report)


FP8_EXPORT = ExportFormat(FORMAT_NAME, REPORT_FILE, _prepare, summary_line, options=_serve_target_option,
                          dtype_field="--dtype", compute_dtype_field="--compute_dtype")
