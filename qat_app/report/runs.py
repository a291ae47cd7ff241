"""Reading one run: its CSVLogger metrics.csv files (every version), saturation summary, config, quantized modules,
per-example records."""

from __future__ import annotations

import csv
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..distill.config import DISTILL_CE
from ..errors import QATError
from ..eval.records import RECORDS_NAME, SAMPLES_DIR  # where the training run writes its per-example records
from ..hif8.inventory import INVENTORY_FILE  # what the fit quantized (QuantizedModulesCallback writes it)


METRICS_FILE = "metrics.csv"
SUMMARY_FILE = "saturation_summary.json"
CONFIG_FILE = "config.yaml"
_VERSION_RE = re.compile(r"^version_(\d+)$")
PRECISION_NAMES = {"32-true": "fp32", "32": "fp32", "64-true": "fp64", "64": "fp64", "bf16-mixed": "BF16",
                   "bf16-true": "BF16", "bf16": "BF16", "16-mixed": "FP16", "16-true": "FP16", "16": "FP16"}


class ReportError(QATError, ValueError):
    """Bad report input; the message names the file."""


def natural_key(text: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(text))]


def _version_number(directory: Path) -> int:
    m = _VERSION_RE.match(directory.name)
    return int(m.group(1)) if m else -1


def find_metrics_files(path: str | os.PathLike) -> list[Path]:
    """The metrics.csv files of one run (oldest version first)."""
    p = Path(path).expanduser()
    if p.is_file():
        if p.name == METRICS_FILE:
            return [p]
        raise ReportError(f"{p}: expected a run directory or a {METRICS_FILE}")
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such run directory")
    if (p / METRICS_FILE).is_file():
        return [p / METRICS_FILE]
    found = sorted(p.rglob(METRICS_FILE), key=lambda f: natural_key(f.relative_to(p)))
    if not found:
        raise FileNotFoundError(
            f"{p}: no {METRICS_FILE} in it or below (expected a CSVLogger run: runs/<name>, "
            f"runs/<name>/logs or runs/<name>/logs/version_N)"
        )
    groups: dict[Path, list[Path]] = {}
    for f in found:
        groups.setdefault(f.parent.parent if _VERSION_RE.match(f.parent.name) else f.parent, []).append(f)
    if len(groups) > 1:
        raise ReportError(f"{p}: holds several runs ({', '.join(map(str, groups))}); pass one of them")
    return sorted(next(iter(groups.values())), key=lambda f: _version_number(f.parent))


def read_metrics(path: str | os.PathLike) -> list[dict[str, float]]:
    """Rows of a CSVLogger metrics.csv as {column: float} (empty cells left out; 'step' is an int)."""
    path = Path(path)
    rows: list[dict[str, float]] = []
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            if not reader.fieldnames or "step" not in reader.fieldnames:
                raise ReportError(f"{path}: not a Lightning CSVLogger metrics file (no 'step' column)")
            for line, raw in enumerate(reader, start=2):
                row: dict[str, float] = {}
                for key, value in raw.items():
                    if key is None or value is None or value == "":
                        continue
                    try:
                        row[key] = float(value)
                    except ValueError:
                        raise ReportError(f"{path}, line {line}: column {key!r} is not a number: {value!r}") from None
                if "step" in row:
                    row["step"] = int(row["step"])
                    rows.append(row)
    except csv.Error as err:
        raise ReportError(f"{path}: malformed CSV ({err})") from None
    except UnicodeDecodeError as err:
        raise ReportError(f"{path}: not a text CSV file ({err})") from None
    return rows


def _read_json_with(path: str | os.PathLike, what: str, keys: tuple[str, ...]) -> dict:
    """A JSON object file that must hold ``keys``; a ReportError naming the file and ``what`` it should be."""
    path = Path(path)
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ReportError(f"{path}: not a readable {what} ({err})") from None
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            raise ReportError(f"{path}: not a {what} (no {key!r})")
    return value


def read_summary(path: str | os.PathLike) -> dict:
    return _read_json_with(path, "saturation summary", ("saturation_events", "clipped", "seen"))


def read_inventory(path: str | os.PathLike) -> dict:
    """A run's quantized_modules.json (what was quantized, the blocks kept in high precision)."""
    return _read_json_with(path, "list of quantized modules", ("totals", "high_precision_blocks", "quantized_blocks"))


def inventory_stats(run: "Run") -> dict | None:
    """What the report shows of a run's quantized_modules.json; None for a run without one (written before it existed)."""
    if run.inventory is None:
        return None
    totals = run.inventory["totals"]
    return {"quantized_modules": totals.get("quantized_modules"), "quantized_parameters": totals.get("quantized_parameters"),
            "quantized_blocks": run.inventory["quantized_blocks"],
            "high_precision_blocks": run.inventory["high_precision_blocks"], "file": run.inventory_path.name}


def read_config(path: str | os.PathLike) -> dict:
    import yaml

    try:
        config = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ReportError(f"{path}: not a readable config ({err})") from None
    if not isinstance(config, dict):
        raise ReportError(f"{path}: not a LightningCLI config (no mapping at the top)")
    return config


def read_samples(path: Path) -> dict[tuple, dict]:
    """Per-example records of one jsonl file, keyed by (task, subject, doc_id)."""
    records: dict[tuple, dict] = {}
    with open(path) as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:
                raise ReportError(f"{path}, line {line_no}: not JSON ({err})") from None
            if not isinstance(record, dict) or "task" not in record or "doc_id" not in record:
                raise ReportError(f"{path}, line {line_no}: not a benchmark record (needs 'task' and 'doc_id')")
            records[(record["task"], record.get("subject") or "", record["doc_id"])] = record
    return records


def flatten(value, prefix: str = "") -> dict[str, object]:
    """Nested config -> {"trainer.logger.0.init_args.save_dir": ...} (empty mappings / lists kept as values)."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else None
    if not items:
        return {prefix: value} if prefix else {}
    out: dict[str, object] = {}
    for k, v in items:
        out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


@dataclass
class Run:
    label: str
    path: Path
    files: list[Path]
    rows: list[list[dict[str, float]]]  # per metrics file
    summary: dict | None = None
    summary_path: Path | None = None
    inventory: dict | None = None  # quantized_modules.json
    inventory_path: Path | None = None
    config: dict | None = None
    config_path: Path | None = None
    samples: dict[tuple[str, int], Path] = field(default_factory=dict)  # (stage, step) -> jsonl
    _columns: set[str] = field(default_factory=set)
    _flat_config: dict | None = None

    @property
    def columns(self) -> set[str]:
        if not self._columns:
            self._columns = {k for rows in self.rows for row in rows for k in row}
        return self._columns

    def series(self, key: str) -> dict[int, float]:
        """step -> value of ``key``; rows of one step are averaged, a later version file wins."""
        out: dict[int, float] = {}
        for rows in self.rows:
            acc: dict[int, list[float]] = {}
            for row in rows:
                if key in row:
                    acc.setdefault(row["step"], []).append(row[key])
            for step, values in acc.items():
                finite = [v for v in values if math.isfinite(v)]
                out[step] = sum(finite) / len(finite) if finite else values[-1]
        return dict(sorted(out.items()))

    def train_loss(self) -> dict[int, float]:
        """step -> the next-token loss: train/loss (``train/loss_step`` when it was also logged per epoch), or for a
        distilled run, whose train/loss is its distillation loss, ``distill/ce`` (comparable with other runs)."""
        for key in (DISTILL_CE, "train/loss", "train/loss_step"):
            if key in self.columns:
                return self.series(key)
        return {}

    def last(self, key: str) -> float | None:
        return last_value(self.series(key))

    def setting(self, dotted: str, default=None):
        """A config field by its dotted name (``trainer.precision``); ``default`` when absent."""
        if self.config is None:
            return default
        if self._flat_config is None:
            self._flat_config = flatten(self.config)
        return self._flat_config.get(dotted, default)

    def tensors(self) -> list[str]:
        """Quantized tensors with per-layer keys in the CSV (``layers.3.mlp.up_proj.input`` ...)."""
        names = set()
        for col in self.columns:
            if col.startswith(("amax/", "a_hat/")):
                names.add(col.split("/", 1)[1])
            elif col.startswith("sat/") and col.endswith("/clipped_frac") and col.count("/") >= 2:
                names.add(col[len("sat/"):-len("/clipped_frac")])
        return sorted(names, key=natural_key)


def last_value(series: dict[int, float]) -> float | None:
    return series[max(series)] if series else None


def fmt(value, spec: str = ".4f") -> str:
    """``value`` formatted with ``spec``; "–" for None or a non-finite float (the tables' empty cell)."""
    return "–" if value is None or (isinstance(value, float) and not math.isfinite(value)) else format(value, spec)


def load_run(path: str | os.PathLike, label: str | None = None) -> Run:
    files = find_metrics_files(path)
    run = Run(label or default_label(path), Path(path), files, [read_metrics(f) for f in files])
    for f in reversed(files):
        if run.summary is None and (f.parent / SUMMARY_FILE).is_file():
            run.summary, run.summary_path = read_summary(f.parent / SUMMARY_FILE), f.parent / SUMMARY_FILE
        if run.inventory is None and (f.parent / INVENTORY_FILE).is_file():
            run.inventory, run.inventory_path = read_inventory(f.parent / INVENTORY_FILE), f.parent / INVENTORY_FILE
        if run.config is None and (f.parent / CONFIG_FILE).is_file():
            run.config, run.config_path = read_config(f.parent / CONFIG_FILE), f.parent / CONFIG_FILE
    for f in files:
        for sample in sorted((f.parent / SAMPLES_DIR).glob("*.jsonl")):
            m = RECORDS_NAME.match(sample.name)
            if m:
                run.samples[(m.group(1), int(m.group(2)))] = sample
    return run


def scored_examples(run: Run, split: str = "val") -> dict[str, tuple[int, int | None]]:
    """Per benchmark task, (examples scored, examples selected) at the run's last evaluation (``<split>/<task>/count``
    and ``/selected``; selected None for a run made before it was logged)."""
    out = {}
    for column in sorted(run.columns, key=natural_key):
        parts = column.split("/")
        if len(parts) == 3 and parts[0] == split and parts[2] == "count":
            scored, selected = run.last(column), run.last(f"{split}/{parts[1]}/selected")
            if scored is not None:
                out[parts[1]] = (int(scored), None if selected is None else int(selected))
    return out


def default_label(path: str | os.PathLike) -> str:
    p = Path(path).expanduser().absolute()
    if p.name == METRICS_FILE:
        p = p.parent
    parts = [part for part in p.parts if not _VERSION_RE.match(part) and part not in ("logs", "csv", "lightning_logs")]
    return parts[-1] if parts else str(path)


def precision_name(run: Run) -> str | None:
    """``trainer.precision`` as a name (fp32 / BF16 / FP16); None without a config."""
    if run.config is None:
        return None
    value = run.setting("trainer.precision")
    return "fp32" if value is None else PRECISION_NAMES.get(str(value), str(value))


def quantized(run: Run) -> bool:
    """False when the config turns quantization off (``model.quant.enabled: false`` or ``model.quant: null``)."""
    if run.config is not None and run.setting("model.quant", "<dict>") is None:
        return False
    return run.setting("model.quant.enabled", True) is not False


def warmup_switch_step(run: Run) -> int | None:
    """The first quantized optimizer step (``warmup.warmup_steps`` when > 0 in a quantized run's config)."""
    steps = run.setting("warmup.warmup_steps")
    return int(steps) if isinstance(steps, (int, float)) and steps > 0 and quantized(run) else None
