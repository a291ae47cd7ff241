#!/usr/bin/env bash
# A bare GPU machine validated in one command, at most 8 minutes (benchmarks/gpu_validation.py does the work):
# the bundle made here by `make gpu-bundle` (.gpu_bundle/: the wheels the GPU image lacks, a tokenizer, a corpus)
# installed into a temporary directory, then every stage under its own time limit, logs in $OUT (or --out),
# one table at the end. Without a GPU: the CPU mode (every stage that needs none, tiny sizes).
#   bash benchmarks/gpu_validation.sh            [--budget 480] [--bundle .gpu_bundle] [--only fit export]
set -uo pipefail
cd "$(dirname "$0")/.."
exec python3 benchmarks/gpu_validation.py "$@"
