"""MkDocs hook: the page marker ``<!-- model-sizes -->`` becomes the table of the models' sizes and what a GPU
holds for them, computed from the models' shapes (:mod:`qat_app.sizing`): never typed by hand."""

from __future__ import annotations

import sys
from pathlib import Path

MARKER = "<!-- model-sizes -->"
ROOT = Path(__file__).resolve().parents[2]


def table() -> str:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from qat_app import sizing

    rows = ["| model | parameters | blocks | quantized linears (k = 5) | their parameters | BF16 weights (a QAD "
            "teacher's too) | training state per GPU, DDP (16 B a parameter) |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for s in (sizing.openpangu_1b(), sizing.embedded_default()):
        rows.append(f"| {s.name} | {s.parameters:,} | {s.blocks} | {s.quantized_linears} | {s.quantized_parameters:,} "
                    f"| {s.teacher_gib:.2f} GiB | {s.training_state_gib:.1f} GiB |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page, config, files) -> str:
    return markdown.replace(MARKER, table()) if MARKER in markdown else markdown
