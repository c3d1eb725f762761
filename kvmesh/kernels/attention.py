"""Attention over a paged KV cache, and the cache write.

Layout: one layer's cache is `[num_pages * page_size, num_kv_heads, head_dim]` (a "slot" is one
token position in one page: `slot = page_id * page_size + offset`). A sequence reads its KV
through the slot list its page table expands to.

`paged_attention_reference` is the portable definition (float32 softmax, explicit masks, no
fused kernels). `plan_attention` picks the fast path for the model's device, once per step:
- on the CPU, `AttentionPlan`: decodes in one call of kvmesh's C++ decode kernel
  (`kernels/csrc/decode_attention.cpp`), prefill chunks in one call of its prefill kernel
  (`kernels/csrc/prefill_attention.cpp`; head sizes that are multiples of 16), anything else
  through torch's fused scaled-dot-product attention per sequence;
- on CUDA, `TritonPlan`: kvmesh's Triton kernels over page tables (`kernels/triton_attention.py`),
  decodes in one split-KV launch and prefill chunks in another.
Tests hold each path to the reference and the reference to dense causal attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvmesh.kernels import native

BACKENDS = ("auto", "triton", "torch")
# What kvmesh's prefill kernel attends: float32, and half precision (bfloat16 on AMX's tile units
# where the CPU has them, `kernels/csrc/prefill_attention.cpp`).
PREFILL_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def plan_attention(seqs: list[SequenceSlice], device: torch.device, backend: str = "auto", page_size: int = 16,
                   sliding_window: int | None = None):
    """The step's attention for `device`: `backend` "auto" takes the C++ kernel on the CPU and the
    Triton kernels on CUDA (torch's attention where those are missing), "triton" the Triton kernels
    anywhere (on the CPU through Triton's interpreter), "torch" torch's attention per sequence."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "triton" or (backend == "auto" and device.type == "cuda" and triton_available()):
        return TritonPlan(seqs, device, page_size, sliding_window)
    return AttentionPlan(seqs, use_kernel=backend == "auto", sliding_window=sliding_window)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


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
    """Stores new tokens' K and V (`[tokens, kv_heads, head_dim]`) at their cache slots: on the
    CPU by kvmesh's row copy (kernels/csrc/kv_write.cpp) where each token's row is contiguous,
    else by `index_copy_`."""
    if (k_cache.device.type == "cpu" and slots.dtype == torch.long and _rows_contiguous(k) and _rows_contiguous(v)
            and (op := native.write_kv())):
        op(k_cache, v_cache, slots.contiguous(), k, v)
        return
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)


def _rows_contiguous(x: torch.Tensor) -> bool:
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


class AttentionPlan:
    """How one step's sequences are attended, worked out once per step and used by every layer.

    Decoding sequences (one query each) go to kvmesh's C++ decode kernel in a single call per
    layer, reading the cache in place through their slot lists (pages that several of them share,
    a cached prefix's, once for all of them: `native.decode_shared_units`); prefill chunks to its prefill
    kernel, likewise in one call (the sliding window, if any, applied there from positions). What
    the kernels cannot take (no C++ compiler, tensors not on the CPU, a head size the prefill
    kernel has no tiles for, a dtype it has no path for) goes to torch's fused attention one
    sequence at a time.
    """

    def __init__(self, seqs: list[SequenceSlice], use_kernel: bool = True, sliding_window: int | None = None):
        self.seqs = seqs
        self.window = sliding_window or _window_of(seqs)
        self.op = native.decode_attention() if use_kernel else None
        self.prefill_op = native.prefill_attention() if use_kernel else None
        self.decodes = [s for s in seqs if s.num_queries == 1] if self.op is not None else []
        self.prefills = [s for s in seqs if s.num_queries != 1] if self.prefill_op is not None else []
        self.others = [s for s in seqs if (s.num_queries == 1 and not self.decodes)
                       or (s.num_queries != 1 and not self.prefills)]
        if self.decodes:
            # A decode's mask, when it has one, is the sliding window: it sees a suffix of its slots.
            visible = [s.slots if s.mask is None else s.slots[s.mask[0]] for s in self.decodes]
            self.rows = torch.tensor([s.query_start for s in self.decodes], dtype=torch.long)
            self.indptr, self.slot_ids = _slot_lists(visible)
        if self.prefills:
            self.starts = torch.tensor([s.query_start for s in self.prefills], dtype=torch.long)
            self.counts = torch.tensor([s.num_queries for s in self.prefills], dtype=torch.long)
            self.prefill_indptr, self.prefill_slots = _slot_lists([s.slots for s in self.prefills])

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """q is `[tokens, heads, head_dim]`; returns the same shape."""
        out = torch.empty_like(q)
        if q.device.type != "cpu":
            per_sequence = self.seqs
        else:
            per_sequence = self.others
            if self.decodes:
                self.op(q, k_cache, v_cache, self.rows, self.indptr, self.slot_ids, scale, out)
            if self.prefills and q.shape[2] % 16 == 0 and q.dtype in PREFILL_KERNEL_DTYPES:
                self.prefill_op(q, k_cache, v_cache, self.starts, self.counts, self.prefill_indptr,
                                self.prefill_slots, self.window, scale, out)
            else:
                per_sequence = per_sequence + self.prefills
        for s in per_sequence:
            _sdpa_one(q, k_cache, v_cache, s, scale, out)
        return out


def _window_of(seqs: list[SequenceSlice]) -> int:
    """The sliding window the slices' masks were made with (`causal_mask`), 0 for none: where it
    matters, the last query does not see position 0 and sees `window` positions."""
    for s in seqs:
        if s.mask is not None and s.num_queries > 1 and not s.mask[-1, 0]:
            return int(s.mask[-1].sum())
    return 0


def _slot_lists(lists: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR form of per-sequence slot lists: (indptr, every slot in order), int64."""
    indptr = torch.zeros(len(lists) + 1, dtype=torch.long)
    indptr[1:] = torch.tensor([x.shape[0] for x in lists]).cumsum(0)
    return indptr, torch.cat(lists).to(torch.long).contiguous()


def _sdpa_one(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, s: SequenceSlice, scale: float, out: torch.Tensor) -> None:
    mask = s.mask
    if s.first_slot is not None:
        k = k_cache[s.first_slot : s.first_slot + s.context_len].transpose(0, 1).unsqueeze(0)
        v = v_cache[s.first_slot : s.first_slot + s.context_len].transpose(0, 1).unsqueeze(0)
    else:
        slots = s.slots.to(k_cache.device)
        k = k_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0)
        v = v_cache.index_select(0, slots).transpose(0, 1).unsqueeze(0)
    if mask is not None and mask.device != q.device:
        mask = mask.to(q.device)
    qs = q[s.query_start : s.query_end].transpose(0, 1).unsqueeze(0)
    is_causal = mask is None and s.num_queries > 1
    o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True)
    out[s.query_start : s.query_end] = o[0].transpose(0, 1)


class TritonPlan:
    """The step's attention through kvmesh's Triton kernels: every decode in one split-KV launch,
    every prefill chunk in another, each reading its sequence's page table (the first slot of
    each of its pages, divided by the page size). The tables, lengths and row offsets are made
    once per step on the host and copied to the device in one transfer per kernel."""

    def __init__(self, seqs: list[SequenceSlice], device: torch.device, page_size: int, sliding_window: int | None):
        from kvmesh.kernels import triton_attention

        self.kernels = triton_attention
        self.page_size = page_size
        self.window = sliding_window
        decodes = [s for s in seqs if s.num_queries == 1]
        prefills = [s for s in seqs if s.num_queries != 1]
        self.decode = self._metadata(decodes, device) if decodes else None
        self.prefill = self._metadata(prefills, device) if prefills else None
        self.max_context = max((s.context_len for s in decodes), default=0)
        self.max_queries = max((s.num_queries for s in prefills), default=0)

    def _metadata(self, seqs: list[SequenceSlice], device: torch.device) -> tuple[torch.Tensor, ...]:
        """(query starts, query counts, context lengths, page tables) on `device`, in one buffer whose
        parts start 16 bytes apart at least: Triton specializes a kernel on its pointers' alignment,
        and parts at odd offsets would compile new variants as the batch size changes."""
        n, ps = len(seqs), self.page_size
        tables = torch.nn.utils.rnn.pad_sequence([s.slots[::ps] // ps for s in seqs], batch_first=True)
        stride = -(-n // 4) * 4
        packed = torch.zeros(3 * stride + tables.numel(), dtype=torch.int32)
        for i, column in enumerate(zip(*((s.query_start, s.num_queries, s.context_len) for s in seqs))):
            packed[i * stride : i * stride + n] = torch.tensor(column, dtype=torch.int32)
        packed[3 * stride :] = tables.reshape(-1)
        if device.type != "cpu":
            packed = packed.pin_memory().to(device, non_blocking=True)
        starts, counts, lengths = (packed[i * stride : i * stride + n] for i in range(3))
        return starts, counts, lengths, packed[3 * stride :].view(n, tables.shape[1])

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        if self.decode is not None:
            rows, _, lengths, tables = self.decode
            self.kernels.decode_attention(q, k_cache, v_cache, out, rows, tables, lengths, scale, self.page_size,
                                          self.max_context, self.window)
        if self.prefill is not None:
            starts, counts, lengths, tables = self.prefill
            self.kernels.prefill_attention(q, k_cache, v_cache, out, starts, counts, tables, lengths, scale,
                                           self.page_size, self.max_queries, self.window)
        return out


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
    acc = torch.promote_types(q.dtype, torch.float32)  # float32, or float64 for a float64 reference
    for s in seqs:
        k = k_cache[s.slots].repeat_interleave(heads // kv_heads, dim=1)  # [ctx, heads, d]
        v = v_cache[s.slots].repeat_interleave(heads // kv_heads, dim=1)
        qs = q[s.query_start : s.query_end]
        scores = torch.einsum("qhd,khd->hqk", qs.to(acc), k.to(acc)) * scale
        q_pos = torch.arange(s.context_len - s.num_queries, s.context_len).unsqueeze(1)
        k_pos = torch.arange(s.context_len).unsqueeze(0)
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = scores.softmax(dim=-1)
        out[s.query_start : s.query_end] = torch.einsum("hqk,khd->qhd", probs, v.to(acc)).to(q.dtype)
    return out
