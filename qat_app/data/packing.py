"""Packing: documents into EOS-separated token blocks of exactly ``seq_len`` tokens.

Every document is tokenised with the model's tokenizer (``add_special_tokens=False``) followed by the
EOS token; the token stream is cut into blocks of exactly ``seq_len`` tokens (no padding, the remainder
is carried over to the next document; at the very end of a finite stream it is dropped). A batch is
``{"input_ids": LongTensor[B, seq_len], "labels": copy of input_ids}`` (the model shifts the labels).
Documents that are empty or tokenise to nothing are skipped (the stream of :mod:`qat_app.data.loader`
warns about them, naming the file and the first such document, once per shard).
"""

from __future__ import annotations

import numpy as np
import torch


def encode_documents(tokenizer, texts: list[str], sep_id: int, dropped: list[int] | None = None) -> list[np.ndarray]:
    """Token ids (+separator) of each non-empty document; documents that tokenise to nothing are dropped
    (their positions in ``texts`` are appended to ``dropped`` when given)."""
    if not texts:
        return []
    ids = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    out = []
    for pos, x in enumerate(ids):
        if len(x):
            a = np.empty(len(x) + 1, dtype=np.int32)
            a[:-1] = x
            a[-1] = sep_id
            out.append(a)
        elif dropped is not None:
            dropped.append(pos)
    return out


def pack_texts(tokenizer, texts: list[str], seq_len: int, sep_id: int | None = None) -> torch.Tensor:
    """Pack documents into ``[n_blocks, seq_len]`` int64 blocks (doc + EOS, remainder dropped)."""
    sep = tokenizer.eos_token_id if sep_id is None else sep_id
    parts = encode_documents(tokenizer, [t for t in texts if t and not t.isspace()], sep)
    if not parts:
        return torch.empty(0, seq_len, dtype=torch.long)
    flat = np.concatenate(parts)
    n = len(flat) // seq_len
    return torch.from_numpy(flat[: n * seq_len].astype(np.int64)).view(n, seq_len)


def collate_blocks(blocks: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    input_ids = torch.stack(blocks).long()
    return {"input_ids": input_ids, "labels": input_ids.clone()}
