"""``python main.py report ...`` / ``python -m qat_app.report ...``: the command line of :func:`build_report`."""

from __future__ import annotations

import logging
import sys

from .. import stats
from ..cli_errors import ProgramParser
from .build import build_report
from .runs import ReportError


def main(argv: list[str] | None = None, prog: str = "python main.py report") -> int:
    """CLI; bad input exits with a message naming the file (SystemExit), success returns 0."""
    args = report_parser(prog).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        report = build_report(args.baseline, args.qat, args.out, args.labels, args.layers, args.benchmarks,
                              args.ape_from_step, args.initial, args.force, args.resamples, args.seed,
                              args.evaluations)
    except (ReportError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(report["markdown"])
    print(f"wrote {', '.join(report['files'])} to {args.out}")
    return 0


def report_parser(prog: str) -> ProgramParser:
    """The flags of ``report``."""
    parser = ProgramParser(
        prog=prog,
        description="Paper-style table (initial / baseline / QAT with paired CIs, training-loss APE, saturation) and figures.",
    )
    parser.add_argument("--baseline", required=True, metavar="DIR", help="the matched baseline run")
    parser.add_argument("--qat", required=True, nargs="+", metavar="DIR", help="one or more QAT runs")
    parser.add_argument("--initial", default=None, metavar="DIR",
                        help="a run (e.g. main.py validate) evaluating the model before training; default: the baseline's step 0")
    parser.add_argument("--labels", nargs="+", default=None, help="names of the QAT runs (or baseline first, then the QAT runs)")
    parser.add_argument("--out", default="reports", metavar="DIR", help="output directory (default: reports)")
    parser.add_argument("--layers", nargs="+", default=None,
                        help="tensors for the a_hat-vs-amax figure: names (layers.10.mlp.down_proj[.input]) or regexes")
    parser.add_argument("--benchmarks", default=None, metavar="REGEX", help="only benchmark metrics matching REGEX")
    parser.add_argument("--ape_from_step", type=int, default=0, help="APE over common steps >= this (default 0: all)")
    parser.add_argument("--force", action="store_true", help="report runs whose configs or steps do not match (with a warning)")
    parser.add_argument("--resamples", type=int, default=stats.DEFAULT_RESAMPLES, help="bootstrap resamples (default 10000)")
    parser.add_argument("--seed", type=int, default=stats.DEFAULT_SEED, help="bootstrap seed (default 0)")
    parser.add_argument("--evaluations", nargs="+", default=None, metavar="DIR",
                        help="output directories of `main.py evaluate` whose paired lm-eval tables are added")
    return parser
