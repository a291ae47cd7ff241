"""Generation speed of one QAT run's exports in the real engine on this CPU: tokens per second of each, against the
BF16 export served by the same vLLM in the same environment.

    python benchmarks/serve_speed.py --ckpt_path runs/quickstart/checkpoints/last.ckpt --out exports/speed

writes (or reuses) three exports of the checkpoint under ``--out``:

- ``fp8``: ``--format compressed-tensors`` (the default ``--serve_target any``), the rest in BF16,
- ``int8``: ``--format compressed-tensors --serve_target cpu``, the rest in BF16,
- ``bf16``: ``--format hf --dtype bfloat16 --hf_weights quantized`` (the trained HiF8 weights, unquantized inputs),

then serves each with ``vllm.LLM`` (``--prompts`` prompts x ``--max_tokens`` greedy tokens after a warm-up, the
engine's own process per export) and prints a table: the kernels vLLM selected, its load time, tokens per second
and the ratio to BF16. An engine still running after ``--timeout`` seconds is stopped; its row says so in one line,
naming its kernels and this CPU. One measurement per export: rerun to see the spread.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qat_app.errors import QATError  # noqa: E402
from qat_app.export import checkpoint_bytes, engine_check  # noqa: E402

EXPORTS = {  # name: the export's flags
    "fp8": ["--format", "compressed-tensors", "--serve_target", "any", "--dtype", "bfloat16"],
    "int8": ["--format", "compressed-tensors", "--serve_target", "cpu", "--dtype", "bfloat16"],
    "bf16": ["--format", "hf", "--dtype", "bfloat16", "--hf_weights", "quantized"],
}
PROMPTS = ("The capital of France is", "Quantization-aware training", "In 1905, Albert Einstein",
           "The recipe for bread needs", "A good night's sleep", "The largest ocean on Earth")


def _export(ckpt: str, out: Path, flags: list[str], reexport: bool) -> None:
    if (out / "config.json").is_file() and not reexport:
        return
    from qat_app.export.cli import main as export_main

    if export_main(["--ckpt_path", ckpt, "--out", str(out), *flags] + (["--overwrite"] if reexport else [])) != 0:
        raise QATError(f"the export to {out} failed (its error is above)")


def serve_one(python: Path, path: Path, prompts: int, max_tokens: int, timeout: float) -> dict:
    """One export in the engine -> its row (kernels, load seconds, tokens, seconds; or the stall line)."""
    request = {"model": str(path.resolve()), "dtype": "bfloat16", "top_k": 1, "prompts": list(PROMPTS[:prompts]),
               "max_tokens": max_tokens, "memory_fraction": 0.15, "sequences": [], "max_model_len": 512}
    try:
        result, kernels = engine_check.run_engine(python, request, timeout)
    except engine_check.EngineError as err:
        return {"error": str(err)}
    return {"kernels": kernels, "load": result["load_seconds"], **result["generation"],
            "first": result["generations"][0]["completion"],
            "mib": checkpoint_bytes(path) / 2**20}


def table(rows: dict[str, dict]) -> str:
    baseline = rows.get("bf16", {})
    base_rate = baseline["tokens"] / baseline["seconds"] if "seconds" in baseline else None
    lines = ["| export | MiB | linear kernels | load s | tokens/s | x BF16 | first completion |",
             "|---|---:|---|---:|---:|---:|---|"]
    for name, row in rows.items():
        if "error" in row:
            lines.append(f"| {name} | | | | stopped | | {row['error']} |")
            continue
        rate = row["tokens"] / row["seconds"]
        kernels = ", ".join(sorted(set(row["kernels"].values()))) or "dense (no quantized scheme)"
        ratio = f"{rate / base_rate:.2f}" if base_rate else ""
        lines.append(f"| {name} | {row['mib']:.1f} | {kernels} | {row['load']:.1f} | {rate:.1f} | {ratio} | {row['first'][:50]!r} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt_path", required=True, help="the run's Lightning checkpoint")
    parser.add_argument("--out", required=True, help="directory of the three exports (reused when present)")
    parser.add_argument("--exports", nargs="+", default=list(EXPORTS), choices=list(EXPORTS))
    parser.add_argument("--prompts", type=int, default=3, choices=range(1, len(PROMPTS) + 1), metavar="N")
    parser.add_argument("--max_tokens", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one export may take in the engine")
    parser.add_argument("--reexport", action="store_true", help="replace the exports under --out")
    parser.add_argument("--vllm_venv", default=str(engine_check.DEFAULT_VENV))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        python = engine_check.engine_python(args.vllm_venv)
        rows = {}
        for name in args.exports:
            _export(args.ckpt_path, Path(args.out) / name, EXPORTS[name], args.reexport)
            rows[name] = serve_one(python, Path(args.out) / name, args.prompts, args.max_tokens, args.timeout)
    except (QATError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{datetime.date.today()}, {engine_check.cpu_features()}; {engine_check.VLLM_PACKAGE} "
          f"{engine_check.VLLM_VERSION}; {args.prompts} prompts x {args.max_tokens} greedy tokens, one measurement each\n")
    print(table(rows))
    return 0 if not any("error" in row for row in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
