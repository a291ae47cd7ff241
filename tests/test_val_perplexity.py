"""benchmarks/val_perplexity.py: its per-sequence NLL is transformers' own loss, sequence by sequence, and its ratio
is exp of the mean paired difference."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from benchmarks import val_perplexity


def test_sequence_nll_is_transformers_loss_per_sequence_and_the_ratio_is_paired(tiny_llama):
    ids = torch.randint(0, 128, (3, 12), generator=torch.Generator().manual_seed(0))
    module = SimpleNamespace(model=tiny_llama.eval())
    nll = val_perplexity.sequence_nll(module, [ids[:2], ids[2:]])
    with torch.no_grad():
        want = torch.stack([tiny_llama(input_ids=row[None], labels=row[None]).loss for row in ids]).double()
    torch.testing.assert_close(nll, want, rtol=1e-5, atol=1e-6)
    other = nll + torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64)
    line = val_perplexity.ratio_line("other", other, nll)
    ratio = float(line.split("|")[3].split()[0])
    assert math.isclose(ratio, math.exp(0.2), rel_tol=1e-4)  # exp of the mean paired difference
    assert float(line.split("|")[2]) == round(math.exp(float(other.mean())), 3)
