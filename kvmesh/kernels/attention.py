"""Attention over a paged KV cache, and the cache write.

Layout: one layer's cache is `[num_pages * page_size, num_kv_heads, head_dim]` (a "slot" is one
token position in one page: `slot = page_id * page_size + offset`). A sequence reads its KV
through the slot list its page table expands to.

`paged_attention_reference` is the portable definition (float32 softmax, explicit masks, no
fused kernels). `AttentionPlan` is the fast path the model uses: decodes in one call of kvmesh's
C++ decode kernel (`kernels/csrc/decode_attention.cpp`), prefill chunks through torch's fused
scaled-dot-product attention per sequence. Tests hold the fast path, with and without the
kernel, to the reference and the reference to dense causal attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvmesh.kernels import native


@dataclass
class SequenceSlice:
    """One sequence's part of a flattened batch.

    `query_start:query_end` are its rows in the flattened query tensor; they are the positions
    `context_len - num_queries .. context_len - 1` of the sequence. `slots` lists the cache slot of
    every position `0 .. context_len - 1` (the new tokens' KV already written).
    """

    query_start: int
    query_end: int
    slots: torch.Tensor
    mask: torch.Tensor | None  # bool [q, ctx], True = attend; None means plain causal from position 0 or one query
    first_slot: int | None = None  # set when the slots are one contiguous run: read the cache in place

    @property
    def num_queries(self) -> int:
        return self.query_end - self.query_start

    @property
    def context_len(self) -> int:
        return int(self.slots.shape[0])


def causal_mask(num_queries: int, context_len: int, sliding_window: int | None = None) -> torch.Tensor | None:
    """The mask for queries at the last `num_queries` positions of `context_len`, or None when
    SDPA's own handling suffices (one query, or causal from position 0, without a window)."""
    window_matters = sliding_window is not None and context_len > sliding_window
    if not window_matters and (num_queries == 1 or num_queries == context_len):
        return None
    q_pos = torch.arange(context_len - num_queries, context_len).unsqueeze(1)
    k_pos = torch.arange(context_len).unsqueeze(0)
    mask = k_pos <= q_pos
    if window_matters:
        mask &= k_pos > q_pos - sliding_window
    return mask


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Stores new tokens' K and V (`[tokens, kv_heads, head_dim]`) at their cache slots."""
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)


class AttentionPlan:
    """How one step's sequences are attended, worked out once per step and used by every layer.

    Decoding sequences (one query each) go to kvmesh's C++ decode kernel in a single call per
    layer, reading the cache in place through their slot lists. Prefill chunks, and everything
    when the kernel is unavailable or the tensors are not on the CPU, go to torch's fused
    attention one sequence at a time: a chunk's arithmetic outweighs the call's fixed cost.
    """

    def __init__(self, seqs: list[SequenceSlice]):
        self.seqs = seqs
        self.op = native.decode_attention()
        self.decodes = [s for s in seqs if s.num_queries == 1] if self.op is not None else []
        self.others = [s for s in seqs if s.num_queries != 1] if self.decodes else seqs
        if self.decodes:
            # A decode's mask, when it has one, is the sliding window: it sees a suffix of its slots.
            visible = [s.slots if s.mask is None else s.slots[s.mask[0]] for s in self.decodes]
            self.rows = torch.tensor([s.query_start for s in self.decodes], dtype=torch.long)
            self.indptr = torch.zeros(len(visible) + 1, dtype=torch.long)
            self.indptr[1:] = torch.tensor([v.shape[0] for v in visible]).cumsum(0)
            self.slot_ids = torch.cat(visible).to(torch.long).contiguous()

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """q is `[tokens, heads, head_dim]`; returns the same shape."""
        out = torch.empty_like(q)
        per_sequence = self.seqs
        if self.decodes and q.device.type == "cpu":
            self.op(q, k_cache, v_cache, self.rows, self.indptr, self.slot_ids, scale, out)
            per_sequence = self.others
        for s in per_sequence:
            _sdpa_one(q, k_cache, v_cache, s, scale, out)
        return out


def _sdpa_one(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, s: SequenceSlice, scale: float, out: torch.Tensor) -> None:
    if s.first_slot is not None:
        k = k_cache[s.first_slot : s.first_slot + s.context_len].transpose(0, 1).unsqueeze(0)
        v = v_cache[s.first_slot : s.first_slot + s.context_len].transpose(0, 1).unsqueeze(0)
    else:
        k = k_cache.index_select(0, s.slots).transpose(0, 1).unsqueeze(0)
        v = v_cache.index_select(0, s.slots).transpose(0, 1).unsqueeze(0)
    qs = q[s.query_start : s.query_end].transpose(0, 1).unsqueeze(0)
    is_causal = s.mask is None and s.num_queries > 1
    o = F.scaled_dot_product_attention(qs, k, v, attn_mask=s.mask, is_causal=is_causal, scale=scale, enable_gqa=True)
    out[s.query_start : s.query_end] = o[0].transpose(0, 1)


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqs: list[SequenceSlice],
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """The portable definition: explicit causal (and sliding-window) mask, float32 softmax."""
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    out = torch.empty_like(q)
    for s in seqs:
        k = k_cache[s.slots].repeat_interleave(heads // kv_heads, dim=1)  # [ctx, heads, d]
        v = v_cache[s.slots].repeat_interleave(heads // kv_heads, dim=1)
        qs = q[s.query_start : s.query_end]
        scores = torch.einsum("qhd,khd->hqk", qs.float(), k.float()) * scale
        q_pos = torch.arange(s.context_len - s.num_queries, s.context_len).unsqueeze(1)
        k_pos = torch.arange(s.context_len).unsqueeze(0)
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = scores.softmax(dim=-1)
        out[s.query_start : s.query_end] = torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)
    return out
