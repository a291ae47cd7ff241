#!/usr/bin/env bash
# GPU validation in one command, at most ~11 minutes on one H200 (each stage has its own time limit):
#   1. the Triton / CUDA kernel tests (bit-exact HiF8 codes, saturation counts, fused linear)
#   2. benchmarks/step_overhead.py --openpangu --device cuda: QAT / BF16 step-time and
#      max_memory_allocated ratios, bf16-mixed, seq 1024 (targets: <= 1.10 and <= 1.0), once with the
#      emulated GEMM (gemm=emulated) and once on FP8 tensor cores (gemm=fp8; goal: at or below BF16), and
#      the FP8 GEMM against the emulated one on the device (forward, dgrad, wgrad of one layer), and the step
#      profile (step_overhead.py --profile: a BF16 and a QAT logging step's time by category, CPU and GPU)
#   3. benchmarks/fsdp_fit.py: a 20-step bf16-mixed fit of an OpenPangu-shaped model through main.py
#      with FSDP2 (ModelParallelStrategy) on one GPU, sharded checkpoint included
# and prints every figure in one table. Usage:  bash benchmarks/gpu_validation.sh   (logs in $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_validation}
mkdir -p "$OUT"
export TOKENIZERS_PARALLELISM=false

timeout 150 python -m pytest -q -p no:cacheprovider tests/test_backends.py tests/test_saturation.py \
  tests/test_linear.py tests/test_gemm.py > "$OUT/kernels.txt" 2>&1
echo "kernels_rc=$?" > "$OUT/status.txt"
timeout 210 python benchmarks/step_overhead.py --openpangu --device cuda --seq-len 1024 --micro-batch 8 \
  > "$OUT/step_overhead.txt" 2>&1
echo "step_overhead_rc=$?" >> "$OUT/status.txt"
timeout 210 python benchmarks/step_overhead.py --openpangu --device cuda --seq-len 1024 --micro-batch 8 --gemm fp8 \
  > "$OUT/step_overhead_fp8.txt" 2>&1
echo "step_overhead_fp8_rc=$?" >> "$OUT/status.txt"
timeout 120 python benchmarks/step_overhead.py --openpangu --device cuda --seq-len 1024 --micro-batch 8 --profile \
  --profile-health > "$OUT/step_profile.txt" 2>&1
echo "step_profile_rc=$?" >> "$OUT/status.txt"
timeout 60 python benchmarks/fp8_check.py --device cuda > "$OUT/fp8_check.txt" 2>&1
echo "fp8_check_rc=$?" >> "$OUT/status.txt"
timeout 180 python benchmarks/fsdp_fit.py --device cuda --steps 20 --out "$OUT/fsdp_fit" > "$OUT/fsdp_fit.txt" 2>&1
echo "fsdp_fit_rc=$?" >> "$OUT/status.txt"

python - "$OUT" <<'PY'
import json, re, sys
from pathlib import Path
out = Path(sys.argv[1])
status = dict(line.strip().split("=") for line in (out / "status.txt").read_text().splitlines())
rows = [("GPU", __import__("torch").cuda.get_device_name(0) if __import__("torch").cuda.is_available() else "none")]
kernels = (out / "kernels.txt").read_text()
summary = [l for l in kernels.splitlines() if re.search(r"\d+ (passed|failed)", l)]
rows.append(("kernel tests", (summary[-1] if summary else "no summary") + f" (rc {status['kernels_rc']})"))
step = (out / "step_overhead.txt").read_text()
for label, pattern in (("step time QAT/BF16 at log interval 50 (target <= 1.05)", r"log_every_n_steps=50: QAT step / bf16 step ([\d.]+)"),
                       ("health, of the step it is measured in (target <= 3 %)", r"health costs ([+-][\d.]+)"),
                       ("peak memory QAT/BF16 (target <= 1.0)", r"peak memory .*ratio ([\d.]+)"),
                       ("peak memory (GiB)", r"peak memory \(max_memory_allocated\): (baseline [\d.]+ GiB\s+QAT [\d.]+ GiB)")):
    m = re.search(pattern, step)
    rows.append((label, m.group(1) if m else f"n/a (rc {status['step_overhead_rc']})"))
fp8 = (out / "step_overhead_fp8.txt").read_text()
for label, pattern in (("step time QAT fp8/BF16 (goal <= 1.0)", r"log_every_n_steps=50: QAT step / bf16 step ([\d.]+)"),
                       ("peak memory QAT fp8/BF16", r"peak memory .*ratio ([\d.]+)")):
    m = re.search(pattern, fp8)
    rows.append((label, m.group(1) if m else f"n/a (rc {status['step_overhead_fp8_rc']})"))
check = [l for l in (out / "fp8_check.txt").read_text().splitlines() if l.startswith("fp8 vs emulated")]
rows.append(("FP8 GEMM vs emulated on the device", check[-1].split(": ", 1)[1] if check else f"n/a (rc {status['fp8_check_rc']})"))
fit = [l for l in (out / "fsdp_fit.txt").read_text().splitlines() if l.startswith("{")]
if fit:
    r = json.loads(fit[-1])
    rows += [("FSDP2 fit: s/step (20 steps, bf16-mixed)", r["seconds_per_step"]), ("FSDP2 fit: peak GiB", r["peak_memory_gib"]),
             ("FSDP2 fit: final loss", r["final_loss"]), ("FSDP2 fit: sharded checkpoint", r["sharded_checkpoint"])]
else:
    rows.append(("FSDP2 fit", f"failed (rc {status['fsdp_fit_rc']}), see {out / 'fsdp_fit.txt'}"))
width = max(len(k) for k, _ in rows)
print("\n".join(f"| {k:<{width}} | {v} |" for k, v in rows))
print("\n".join(l for l in (out / "step_profile.txt").read_text().splitlines() if not l.startswith(("Loading", "USDT"))))
PY
