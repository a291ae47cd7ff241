"""``python main.py export ...`` / ``python -m qat_app.export ...``: a QATModule checkpoint -> an export.

``--format compressed-tensors --compare --config RUN.yaml`` also measures what serving changes
(:mod:`.served`): every flag it does not know (``--config``, ``--data.*``, ``--model.*``) goes to the LightningCLI
parser of ``main.py validate``, which builds the run's data: its held-out text and its benchmarks."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import torch

from ..cli_errors import ProgramParser, unknown_flags_line
from ..errors import QATError
from ..hif8.inventory import INVENTORY_FILE, inventory_summary
from .compressed import FORMAT_NAME
from .formats import FORMATS
from .serve_targets import DEFAULT_SERVE_TARGET, SERVE_TARGETS
from .layout import ExportError
from .qat_checkpoint import load_qat_checkpoint, run_compute_dtype, run_dtype
from .writing import write_export


def main(argv: list[str] | None = None, prog: str = "python -m qat_app.export") -> int:
    """CLI; returns the exit status (2, with one ``error: ...`` line, for bad input)."""
    parser = export_parser(prog)
    args, lightning_args = parser.parse_known_args(argv)
    check_arguments(parser, args, lightning_args)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        run_export(args, lightning_args)
    except (QATError, FileNotFoundError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def export_parser(prog: str) -> ProgramParser:
    """The flags of ``export`` (``--ckpt`` is still read as ``--ckpt_path``, with a deprecation line)."""
    parser = ProgramParser(
        prog=prog,
        description="Export a QATModule Lightning checkpoint as an 8-bit HiF8 checkpoint, a plain HF directory, or an "
                    "FP8 compressed-tensors checkpoint for vLLM.",
    )
    parser.add_argument("--ckpt_path", required=True, metavar="FILE|DIR", help="Lightning checkpoint of a QATModule: a "
                        ".ckpt file, or the directory of a sharded (FSDP2) one, read whole (also --ckpt, deprecated)")
    parser.add_argument("--out", required=True, help="output directory (must not exist or be empty, unless --overwrite)")
    parser.add_argument("--format", choices=tuple(FORMATS), default="hif8",
                        help="hif8: the 8-bit HiF8 checkpoint (exact reloads); hf: plain Hugging Face; "
                             f"{FORMAT_NAME}: FP8 E4M3 for vLLM / transformers")
    parser.add_argument("--dtype", default=None,
                        help="hif8 / compressed-tensors: dtype of the unquantized tensors (default: the one the run "
                             "computed them in: float32 for 32-true, bfloat16 for bf16-mixed); hf: parameter dtype "
                             "(default unchanged)")
    parser.add_argument("--compute_dtype", default=None,
                        help="dtype the weight codes are computed in (default: the one the run computed its quantized "
                             "linears in: bfloat16 for bf16-mixed, float32 for 32-true; an override says how many "
                             "codes it changed)")
    parser.add_argument("--hf_weights", choices=("master", "quantized"), default="master",
                        help="hf: trained high-precision weights, or the fake-quantized 8-bit-grid weights")
    parser.add_argument("--serve_target", choices=tuple(SERVE_TARGETS), default=DEFAULT_SERVE_TARGET,
                        help=f"{FORMAT_NAME}: any (default): FP8 with dynamic per-token input scales, served by vLLM "
                             "on CUDA and (slowly) on the CPU; cuda: FP8 with the trained static input scales "
                             "(closest to training), vLLM's CUDA kernels only; cpu: int8 weights and per-token int8 "
                             "inputs, what vLLM serves fast on an x86-64 CPU")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing export directory")
    parser.add_argument("--weights_only", type=_boolean, default=True, metavar="true|false",
                        help="load the checkpoint as data only (default true; torch's weights-only unpickler). "
                             "false runs whatever the file pickled: only for a file you trust")
    parser.add_argument("--trust_remote_code", action="store_true",
                        help="let transformers run the model's own code from its hub or local directory (never "
                             "turned on by what a checkpoint or an export holds)")
    parser.add_argument("--compare", action="store_true",
                        help=f"{FORMAT_NAME}: emulate the served forward on the CPU and compare it with the QAT model on "
                             "the run's held-out text and benchmarks (give the run's --config; other LightningCLI "
                             "flags such as --data.* pass through)")
    parser.add_argument("--compare_batches", type=int, default=8, metavar="N",
                        help="--compare: batches of held-out text (default 8)")
    parser.add_argument("--compare_device", default="cpu", metavar="DEVICE",
                        help="--compare: where both models run (default cpu; e.g. cuda for a large model)")
    parser.add_argument("--compare_dtype", default="float32", metavar="DTYPE",
                        help="--compare: the dtype the served side runs in (default float32: the stored tensors and "
                             "the FP8 numerics alone; bfloat16: activations rounded as vLLM serves them)")
    return parser


def check_arguments(parser: ProgramParser, args: argparse.Namespace, lightning_args: list[str]) -> None:
    """Flags that contradict each other, before anything is read (``parser.error`` exits with status 2)."""
    if lightning_args and not args.compare:
        line = unknown_flags_line(lightning_args, parser)
        parser.error(line if "did you mean" in line else line + " (LightningCLI flags are read with --compare)")
    if args.serve_target != DEFAULT_SERVE_TARGET and args.format != FORMAT_NAME:
        parser.error(f"--serve_target: only with --format {FORMAT_NAME}")
    if args.compare and args.format != FORMAT_NAME:
        parser.error(f"--compare: only with --format {FORMAT_NAME}")
    if args.compare_batches < 1:
        parser.error(f"--compare_batches: must be >= 1, got {args.compare_batches}")


def run_export(args: argparse.Namespace, lightning_args: list[str]) -> None:
    """Load the checkpoint and write the asked format, then one line on what was quantized."""
    from qat_app.models import resolve_dtype

    for flag, value in (("--dtype", args.dtype), ("--compute_dtype", args.compute_dtype),
                        ("--compare_dtype", args.compare_dtype)):
        if value is not None:
            resolve_dtype(value, field=flag)
    if Path(args.out).exists() and Path(args.out).is_dir() and any(Path(args.out).iterdir()) and not args.overwrite:
        raise FileExistsError(f"{args.out} already exists and is not empty; pass --overwrite to replace it")
    fmt = FORMATS[args.format]
    options = fmt.options(args)
    module = load_qat_checkpoint(args.ckpt_path, weights_only=args.weights_only, trust_remote_code=args.trust_remote_code)
    storage, why = run_dtype(module)
    if fmt.run_dtype:
        _say_storage(args.dtype, storage, why)
    compute_dtype = _compute_dtype(module, args.compute_dtype) if fmt.computes_codes(options) else args.compute_dtype
    device = _compare_device(args.compare_device) if args.compare else None
    datamodule = _datamodule(lightning_args) if args.compare else None  # bad data flags before any writing
    report = write_export(fmt, module, args.out, dtype=args.dtype or (storage if fmt.run_dtype else None),
                          compute_dtype=compute_dtype, overwrite=args.overwrite, **options)
    print(fmt.summary(args.out, report))
    if datamodule is not None:
        _compare(module, args.out, datamodule, args.compare_batches, device,
                 resolve_dtype(args.compare_dtype, field="--compare_dtype"), run_floor(lightning_args))
    inventory = Path(args.out) / INVENTORY_FILE
    if inventory.is_file():
        print(f"{inventory_summary(json.loads(inventory.read_text()))} [{inventory}]")


def _say_storage(asked: str | None, storage: str, why: str) -> None:
    """One line on the unquantized tensors' dtype, and what an override costs."""
    from qat_app.models import resolve_dtype

    if asked is None:
        print(f"unquantized tensors stored in {storage} ({why}; --dtype overrides)")
    elif resolve_dtype(asked).itemsize < resolve_dtype(storage).itemsize:
        print(f"--dtype {asked}: the unquantized tensors are rounded from the run's {storage} ({why}); on the CPU "
              "quickstart (32-true) the BF16 FP8 export served by vLLM lost 0.9% perplexity [0.4%, 1.5%] against "
              "-0.2% [-0.8%, +0.4%] stored and served in float32")


def _compute_dtype(module, asked: str | None) -> str | None:
    """The dtype the codes are computed in: the run's, or ``asked``; one line on which, and on what an override
    changed (the codes that differ from the ones the run trained with)."""
    from qat_app.models import resolve_dtype

    from .source import changed_codes

    trained, why = run_compute_dtype(module)
    if asked is None:
        print(f"weight codes computed in {trained or 'the weights dtype'} ({why}; --compute_dtype overrides)")
        return trained
    if trained is not None and resolve_dtype(asked) != resolve_dtype(trained):
        changed, total = changed_codes(module.model, resolve_dtype(trained), resolve_dtype(asked))
        print(f"--compute_dtype {asked}: {changed:,} of {total:,} weight codes differ from the ones the run trained "
              f"with ({trained}, {why})")
    return asked


def _datamodule(lightning_args: list[str]):
    """The run's datamodule, as ``main.py validate`` builds it from ``lightning_args`` (``--config`` ...)."""
    import warnings

    from .. import preflight
    from ..cli import QATCLI, cli_kwargs

    if not any(arg == "--config" or arg.startswith("--config=") for arg in lightning_args):
        raise ExportError("--compare: give the run's --config FILE (its data section holds the held-out text and the "
                          "benchmarks to compare on)")

    class DataCLI(QATCLI):
        def before_validate(self) -> None:
            preflight.check_data(self.datamodule, 1)

        def validate(self, model, datamodule=None, **_) -> None:
            self.captured = datamodule

    with warnings.catch_warnings():  # the args are ours, built from the command line
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        return DataCLI(**cli_kwargs(), args=["validate", *lightning_args], run=True).captured


def _compare_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ExportError(f"--compare_device {name!r}: not a torch device (cpu, cuda, cuda:1 ...)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ExportError(f"--compare_device {name}: this machine has no CUDA device; use cpu")
    return device


def _boolean(value: str) -> bool:
    lowered = str(value).lower()
    if lowered not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")
    return lowered == "true"


def run_floor(lightning_args: list[str]) -> dict | None:
    """The run's ``noise_floor.json`` beside its ``--config`` (the log directory's ``config.yaml``), if any."""
    from ..eval.records import NOISE_FLOOR_FILE, read_noise_floor

    for i, arg in enumerate(lightning_args):
        config = arg.split("=", 1)[1] if arg.startswith("--config=") else (
            lightning_args[i + 1] if arg == "--config" and i + 1 < len(lightning_args) else None)
        if config:
            return read_noise_floor(os.path.join(os.path.dirname(os.path.abspath(config)), NOISE_FLOOR_FILE))
    return None


def _compare(module, out_dir: str, datamodule, batches: int, device: torch.device, dtype: torch.dtype,
             floor: dict | None = None) -> None:
    from ..inspection import text_batches
    from .served import compare_served, load_served, render, write_comparison

    pretraining = hasattr(datamodule, "make_val_dataloader")  # held-out text (+ its benchmarks), else benchmarks
    benchmarks = getattr(datamodule, "benchmarks", None) if pretraining else datamodule
    blocks, what = text_batches(datamodule, "auto", batches) if pretraining else (None, "")
    served = load_served(out_dir, dtype=dtype, trust_remote_code=bool(module.hparams.get("trust_remote_code")))
    # (module.hparams.trust_remote_code is the command line's --trust_remote_code: load_qat_checkpoint set it)
    blocks = None if blocks is None else [ids.to(device) for ids in blocks]
    comparison = compare_served(module.model.to(device), served.to(device), blocks, benchmarks, text_what=what)
    comparison.run_floor = floor
    comparison.notes.append(f"emulated on {device}: the served side is the export loaded by transformers in "
                            f"{str(dtype).removeprefix('torch.')} (compressed-tensors: E4M3 inputs at the export's scales, "
                            "per token or static, E4M3 weights); vLLM itself runs it in benchmarks/serve_vllm.py"
                            + ("; in bfloat16 the FP8 layers' dequantized weights and inputs are rounded to bfloat16 "
                               "too (vLLM multiplies the E4M3 values themselves): one rounding more than serving"
                               if dtype == torch.bfloat16 else "; its activations here are float32, not BF16 (--compare_dtype bfloat16)"))
    print(render(comparison))
    print("wrote " + ", ".join(write_comparison(comparison, out_dir)))
