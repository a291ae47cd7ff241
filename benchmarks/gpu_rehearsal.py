"""``make gpu-rehearsal``: the GPU validation's CPU mode run here in the GPU image's Python and packages.

1. A Python 3.12 (the image's): ``$QAT_APP_PYTHON312``, else ``python3.12`` on PATH, else pyenv's newest 3.12. With
   none, one line says how to get one, and the rehearsal stops (exit 2): it never passes without running.
2. A virtual environment of the image's packages (:data:`IMAGE_LIST`, ``benchmarks/gpu_image.txt``: torch 2.11,
   transformers 5.17, ...) in ``~/.cache/qat_app/gpu-image-py312`` (``$QAT_APP_GPU_IMAGE_VENV``), built once and
   reused while the list it recorded is this checkout's; it must hold none of the packages the image lacks.
3. The bundle (``.gpu_bundle``, what ``make gpu-bundle`` writes), rebuilt unless it is this checkout's: for Python
   3.12, the wheels of every missing and pinned package at the versions installed here.
4. ``bash benchmarks/gpu_validation.sh --cpu`` with that environment's python first on PATH, so the bundle is
   installed as on the device (``pip --target`` into a temporary directory, first on PYTHONPATH). The validation's
   table, then one line: exit 0 only when the bundle and every CPU stage are ok (the GPU-only stages wait).

    python benchmarks/gpu_rehearsal.py [--venv DIR] [--bundle DIR] [--out DIR] [--budget SECONDS]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import gpu_bundle

ROOT = Path(__file__).resolve().parents[1]
IMAGE_LIST = ROOT / "benchmarks" / "gpu_image.txt"
IMAGE_PYTHON = (3, 12)
DEFAULT_VENV = Path("~/.cache/qat_app/gpu-image-py312").expanduser()
RECORD = "gpu_image.txt"  # in the environment: the list it was built from (and its Python)
NO_PYTHON = ("error: gpu-rehearsal needs a Python 3.12 (the GPU image's) and found none (not python3.12 on PATH, "
             "not under pyenv): install one (`pyenv install 3.12`, or `apt-get install python3.12 python3.12-venv`) "
             "or name it with QAT_APP_PYTHON312=/path/to/python3.12")


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(text: str) -> dict[str, str]:
    """{normalized name: version} of the list's ``name==version`` lines (comments and blank lines skipped)."""
    found = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, pinned = line.partition("==")
            found[normalized(name)] = pinned.strip()
    return found


def _is_python312(path: str) -> bool:
    try:
        done = subprocess.run([path, "-c", "import sys, venv; print(sys.version_info[:2])"], capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and done.stdout.strip() == str(IMAGE_PYTHON)


def find_python312() -> str | None:
    """A Python 3.12 that runs (with venv): ``$QAT_APP_PYTHON312``, ``python3.12`` on PATH (a pyenv shim that
    does not run is passed over), pyenv's newest 3.12; None where there is none."""
    candidates = [os.environ.get("QAT_APP_PYTHON312"), shutil.which("python3.12")]
    pyenv_root = os.environ.get("PYENV_ROOT")
    if not pyenv_root and shutil.which("pyenv"):
        done = subprocess.run(["pyenv", "root"], capture_output=True, text=True)
        pyenv_root = done.stdout.strip() if done.returncode == 0 else None
    pyenv_root = Path(pyenv_root or "~/.pyenv").expanduser()
    releases = [p for p in pyenv_root.glob("versions/3.12.*/bin/python3.12") if re.fullmatch(r"3\.12\.\d+", p.parts[-3])]
    candidates += [str(p) for p in sorted(releases, key=lambda p: int(p.parts[-3].split(".")[2]), reverse=True)]
    return next((c for c in candidates if c and _is_python312(c)), None)


def record_text(python: str) -> str:
    done = subprocess.run([python, "-c", "import sys; print(sys.version.split()[0])"], capture_output=True, text=True)
    return f"# python {done.stdout.strip()} ({python})\n" + IMAGE_LIST.read_text()


def installed(venv_python: Path) -> dict[str, str]:
    """{normalized name: version} of every distribution in the environment."""
    done = subprocess.run([str(venv_python), "-c", "import importlib.metadata as m, json; print(json.dumps("
                           "{d.metadata['Name']: d.version for d in m.distributions()}))"],
                          capture_output=True, text=True, check=True)
    return {normalized(k): v for k, v in json.loads(done.stdout).items()}


def build_environment(python: str, venv: Path) -> Path:
    """The image's environment in ``venv`` (reused while its record is this list's); its python."""
    venv_python = venv / "bin" / "python"
    wanted = record_text(python)
    record = venv / RECORD
    if venv_python.is_file() and record.is_file() and record.read_text() == wanted:
        print(f"gpu-rehearsal: the image's environment {venv} is up to date (its list is {IMAGE_LIST.name})", flush=True)
        return venv_python
    if venv.exists() and any(venv.iterdir()) and not (venv / "pyvenv.cfg").is_file():
        raise SystemExit(f"error: gpu-rehearsal: {venv} is neither empty nor a virtual environment: not replaced "
                         "(name another with QAT_APP_GPU_IMAGE_VENV or --venv)")
    start = time.monotonic()
    shutil.rmtree(venv, ignore_errors=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    print(f"gpu-rehearsal: building the image's environment in {venv} from {IMAGE_LIST.name} ({python})", flush=True)
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv_python), "-m", "pip", "install", "-q", "-r", str(IMAGE_LIST)], check=True)
    have = installed(venv_python)
    listed = image_packages(IMAGE_LIST.read_text())
    wrong = sorted(f"{n} {have.get(n)} (listed {v})" for n, v in listed.items() if have.get(n, "").split("+")[0] != v)
    extra = sorted(n for n in map(normalized, gpu_bundle.MISSING) if n in have)
    if wrong or extra:
        raise SystemExit(f"error: gpu-rehearsal: {venv} is not the image: "
                         + "; ".join(([f"installed at other versions: {', '.join(wrong)}"] if wrong else [])
                                     + ([f"holds what the image lacks: {', '.join(extra)}"] if extra else [])))
    record.write_text(wanted)
    print(f"gpu-rehearsal: built in {time.monotonic() - start:.0f} s", flush=True)
    return venv_python


def bundle_is_current(bundle: Path) -> bool:
    """Whether ``bundle`` is the one ``make gpu-bundle`` would write now: Python 3.12, every missing and pinned
    package at the version installed here, and its assets."""
    manifest = bundle / "manifest.json"
    if not manifest.is_file() or not (bundle / "assets" / "tokenizer").is_dir():
        return False
    info = json.loads(manifest.read_text())
    want = sorted((n, version(n)) for n in gpu_bundle.MISSING + gpu_bundle.PINNED)
    have = sorted((w["name"], w["version"]) for w in info.get("wheels", []))
    files = all(w.get("file") and (bundle / "wheels" / w["file"]).is_file() for w in info.get("wheels", []))
    return info.get("python") == "%d.%d" % IMAGE_PYTHON and have == want and files


def table_problems(table: str) -> list[str]:
    """The rows of the validation's table that are not ok: the bundle must be installed, every stage ok (or
    waiting for a GPU)."""
    problems = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or cells[0] in ("stage", "gpu") or set(cells[0]) <= {"-"}:
            continue
        name, status = cells[0], cells[1]
        if status != "ok" and not (status == "WAITS" and name != "bundle"):
            problems.append(f"{name} {status}")
    return problems if any(line.startswith("| bundle ") for line in table.splitlines()) else ["no table"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--venv", default=os.environ.get("QAT_APP_GPU_IMAGE_VENV") or str(DEFAULT_VENV))
    p.add_argument("--bundle", default=str(ROOT / ".gpu_bundle"))
    p.add_argument("--out", default=None, help="the validation's logs and table (default: /tmp/gpu_rehearsal, the "
                                                "last run's only)")
    p.add_argument("--budget", type=float, default=1500.0,
                   help="seconds for the validation's stages together (default 1500: this CPU is slower than the "
                        "device's)")
    args = p.parse_args(argv)
    python = find_python312()
    if python is None:
        print(NO_PYTHON, file=sys.stderr)
        return 2
    venv_python = build_environment(python, Path(args.venv).expanduser())
    bundle = Path(args.bundle)
    if not bundle_is_current(bundle):
        print(f"gpu-rehearsal: writing the bundle {bundle} (make gpu-bundle)", flush=True)
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_bundle.py"), "--out", str(bundle),
                        "--python", "%d.%d" % IMAGE_PYTHON], check=True)
    out = Path(args.out or Path(tempfile.gettempdir()) / "gpu_rehearsal")
    if args.out is None:
        shutil.rmtree(out, ignore_errors=True)  # the last run's logs only (a run writes a few hundred MB)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env.update(PATH=f"{venv_python.parent}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv_python.parent.parent))
    command = ["bash", str(ROOT / "benchmarks" / "gpu_validation.sh"), "--cpu", "--bundle", str(bundle),
               "--out", str(out), "--budget", str(args.budget)]
    print(f"gpu-rehearsal: {' '.join(command)} (python3: {venv_python})", flush=True)
    code = subprocess.run(command, cwd=ROOT, env=env).returncode
    table = (out / "table.md").read_text() if (out / "table.md").is_file() else ""
    problems = table_problems(table)
    if problems or code != 0:
        print(f"error: gpu-rehearsal: not every CPU stage passed in the GPU image's environment: "
              f"{', '.join(problems) or f'exit {code}'} (logs in {out})", file=sys.stderr)
        return 1
    print(f"gpu-rehearsal: every CPU stage ok in the GPU image's environment ({venv_python}; logs in {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
