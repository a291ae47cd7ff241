"""Lightning's precision settings as dtypes: what a run computed in, read by training (the teacher), the exports
and the lm-eval wrappers alike (a table below all of them, so none imports another for it)."""

from __future__ import annotations

# Lightning precision -> the dtype its unquantized tensors were computed in (the exports keep it by default)
PRECISION_DTYPES = {"32-true": "float32", "32": "float32", "64-true": "float32", "bf16-mixed": "bfloat16",
                    "bf16-true": "bfloat16", "bf16": "bfloat16", "16-mixed": "float16", "16-true": "float16",
                    "16": "float16"}
# Lightning precision -> the dtype its quantized linears computed in (what the weight's codes are the codes of:
# under bf16-mixed, bf16(w) * s, whatever the master weights' dtype)
COMPUTE_DTYPES = {**PRECISION_DTYPES, "64-true": "float64", "64": "float64"}
