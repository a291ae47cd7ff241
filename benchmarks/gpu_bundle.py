"""``make gpu-bundle``: what a bare GPU machine needs to validate this project, in one ignored folder (<= 60 MiB).

Run here (with PyPI reachable); ``bash benchmarks/gpu_validation.sh`` installs it there into a temporary directory.

* ``wheels/``: the packages the GPU image lacks (:data:`MISSING`) and the ones whose image version differs from the
  project's pin where the project needs the pin (:data:`PINNED`), for the image's Python (default 3.12, x86-64
  manylinux), at the versions installed here (``requirements.txt``'s). torch, CUDA and triton stay the image's.
* ``assets/``: the embedded tokenizer (SmolLM2's, saved as a plain HF tokenizer) and a few MB of the embedded
  corpus as JSON lines; the 94 MB model and the benchmark data do not travel (the fits use random weights).
* ``manifest.json``: the Python it is for, every wheel with its version, the assets, the size.

    python benchmarks/gpu_bundle.py --out .gpu_bundle
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT_MIB = 60
# measured on the H200 image (Python 3.12.3, torch 2.11.0+cu130): not installed there, and needed
MISSING = ("docstring-parser", "jsonargparse", "typeshed-client", "en-dtypes", "datasets", "dill", "multiprocess",
           "torchdata", "gguf", "compressed-tensors", "pydantic", "pydantic-core", "annotated-types",
           "typing-inspection", "loguru")
# there in another version (or one not recorded), and the project needs its pin (transformers 5.17 there: the
# model classes and the GGUF / openPangu loading are tested against 5.24)
PINNED = ("transformers",
          "regex")  # transformers checks its version at import (>= 2025.10.22); the image's is not recorded
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
CORPUS_BYTES = 3 * 2**20


def download_wheels(out: Path, python: str, names: tuple[str, ...]) -> list[dict]:
    """``pip download`` of each of ``names`` at the version installed here -> [{name, version, file}]."""
    out.mkdir(parents=True, exist_ok=True)
    wheels = []
    for name in names:
        pinned = version(name)
        before = set(out.iterdir())
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                   "--python-version", python, "--implementation", "cp", "-d", str(out), f"{name}=={pinned}"]
        for platform in PLATFORMS:
            command[6:6] = ["--platform", platform]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"error: gpu-bundle: {name}=={pinned} for Python {python}: {done.stderr.strip()[-400:]}")
        new = sorted(set(out.iterdir()) - before) or sorted(out.glob(f"{name.replace('-', '_')}-{pinned}-*.whl"))
        wheels.append({"name": name, "version": pinned, "file": new[0].name if new else None})
    return wheels


def write_assets(out: Path) -> dict:
    """The tokenizer and a slice of the embedded corpus (whole documents, about :data:`CORPUS_BYTES`)."""
    from qat_app.data.corpus import boolq_passages_path
    from qat_app.models import load_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    load_tokenizer().save_pretrained(out / "tokenizer")
    corpus, size = [], 0
    with open(boolq_passages_path()) as source:
        for line in source:
            if size >= CORPUS_BYTES:
                break
            corpus.append(line)
            size += len(line.encode())
    (out / "corpus.jsonl").write_text("".join(corpus))
    return {"tokenizer": "assets/tokenizer", "corpus": "assets/corpus.jsonl", "corpus_documents": len(corpus)}


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / ".gpu_bundle"))
    p.add_argument("--python", default="3.12", help="the GPU image's Python (default 3.12)")
    p.add_argument("--packages", nargs="*", default=None, help="only these (default: every missing and pinned one)")
    args = p.parse_args(argv)
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    names = tuple(args.packages) if args.packages is not None else MISSING + PINNED
    wheels = download_wheels(out / "wheels", args.python, names)
    assets = write_assets(out / "assets")
    manifest = {"python": args.python, "built": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "wheels": wheels,
                "assets": assets}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    size = folder_bytes(out)
    manifest["bytes"] = size
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    if size > LIMIT_MIB * 2**20:
        print(f"error: gpu-bundle: {out} is {size / 2**20:.1f} MiB, over {LIMIT_MIB} MiB (what travels to a GPU "
              "machine is limited)", file=sys.stderr)
        return 2
    print(f"wrote {out}: {len(wheels)} wheels for Python {args.python}, tokenizer and "
          f"{assets['corpus_documents']} documents, {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
