"""What several benchmark scripts share: their integer options, timing one call on a device, writing their figures
as JSON.

The scripts run as ``python benchmarks/NAME.py`` import it by its bare name (``from _common import seconds``), the
ones Lightning also loads by class path as ``benchmarks._common``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


def int_options(parser, **defaults: int | None) -> None:
    """One ``--name`` option of type int per keyword, in their order (``seq_len=1024``: ``--seq-len``, default
    1024)."""
    for name, default in defaults.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)


def seconds(fn, device) -> float:
    """Wall-clock seconds of ``fn()`` on ``device`` (a name or a ``torch.device``): a CUDA device is synchronized
    before and after, so that its queued kernels count where they run."""
    import torch

    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def write_json(path: str | Path, value: dict) -> None:
    """``value`` as JSON (indented by 2) at ``path``, its folder made first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2))
