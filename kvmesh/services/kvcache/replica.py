"""Page-pool replication by operation log.

The scheduler decides with its own `RecordingPagePool` (no network call inside a step) and
ships the step's operations to the kvcache service in one batched call after the step; the
service replays them on its copy. PagePool is deterministic, so both copies stay identical;
`apply_ops` reports a divergence when a replayed GROW hands out different pages.
"""

from __future__ import annotations

from kvmesh.params import MAX_REQUEST_ID_CHARS, InvalidRequest
from kvmesh.services.kvcache.pages import PagePool
from kvmesh.v1 import kvcache_pb2

Op = kvcache_pb2.PageOp
MAX_OPS_PER_APPLY = 65536  # one step's operations: a few per running sequence
MAX_PAGE_SIZE = 65536


class RecordingPagePool(PagePool):
    """A PagePool that records every change as a PageOp until `drain()`. OPEN and RELEASE carry
    the sequence's trace context from `traceparents` (seq id -> W3C traceparent), when it has one."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ops: list[kvcache_pb2.PageOp] = []
        self.traceparents: dict[str, str] = {}

    def open(self, seq_id, prefix_pages):
        super().open(seq_id, prefix_pages)
        self.ops.append(Op(kind=Op.OPEN, seq_id=seq_id, page_ids=prefix_pages,
                           traceparent=self.traceparents.get(seq_id, "")))

    def grow(self, seq_id, num_tokens):
        pages = PagePool.grow(self, seq_id, num_tokens)
        if pages:
            self.ops.append(Op(kind=Op.GROW, seq_id=seq_id, num_tokens=num_tokens, page_ids=pages))
        return pages

    def commit(self, seq_id, token_ids, num_computed, first_page=0):
        before = self.num_committed(seq_id)
        super().commit(seq_id, token_ids, num_computed, first_page)
        after = self.num_committed(seq_id)
        if after > before:  # the op carries only the newly published pages' tokens
            at = (before - first_page) * self.page_size
            self.ops.append(Op(kind=Op.COMMIT, seq_id=seq_id, num_tokens=num_computed,
                               token_ids=token_ids[at : at + (after - before) * self.page_size]))

    def release(self, seq_id):
        if seq_id in self.tables:
            self.ops.append(Op(kind=Op.RELEASE, seq_id=seq_id, traceparent=self.traceparents.get(seq_id, "")))
        super().release(seq_id)

    def drain(self) -> list[kvcache_pb2.PageOp]:
        ops, self.ops = self.ops, []
        return ops


def check_apply(request: kvcache_pb2.ApplyRequest, max_pages: int) -> None:
    """Raises InvalidRequest (naming the field and the limit) for an ApplyRequest that no
    scheduler's replica could have recorded, before anything is applied or allocated: a pool
    over `max_pages` pages, too many operations, a page outside the pool, an overlong seq_id."""
    if not 1 <= request.num_pages <= max_pages:
        raise InvalidRequest("num_pages", f"must be in [1, {max_pages}] (max_pages_per_worker), got {request.num_pages}")
    if not 1 <= request.page_size <= MAX_PAGE_SIZE:
        raise InvalidRequest("page_size", f"must be in [1, {MAX_PAGE_SIZE}], got {request.page_size}")
    if len(request.ops) > MAX_OPS_PER_APPLY:
        raise InvalidRequest("ops", f"has {len(request.ops)} operations, over the limit of {MAX_OPS_PER_APPLY}")
    for i, op in enumerate(request.ops):
        if op.page_ids and max(op.page_ids) >= request.num_pages:
            raise InvalidRequest(f"ops[{i}].page_ids", f"page {max(op.page_ids)} is outside the pool [0, {request.num_pages})")
        if len(op.seq_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequest(f"ops[{i}].seq_id", f"has {len(op.seq_id)} characters, over the limit of {MAX_REQUEST_ID_CHARS}")


def apply_ops(pool: PagePool, ops) -> bool:
    """Replays ops in order; returns True if the replica diverged from the recorder (a GROW got
    other pages, or an op does not fit the pool's state, e.g. it names an unknown sequence)."""
    try:
        return _replay(pool, ops)
    except (KeyError, ValueError, IndexError):
        return True


def _replay(pool: PagePool, ops) -> bool:
    for op in ops:
        if op.kind == Op.OPEN:
            pool.open(op.seq_id, list(op.page_ids))
        elif op.kind == Op.GROW:
            if pool.grow(op.seq_id, op.num_tokens) != list(op.page_ids):
                return True
        elif op.kind == Op.COMMIT:  # token_ids start at the first page not yet published
            pool.commit(op.seq_id, list(op.token_ids), op.num_tokens, first_page=pool.num_committed(op.seq_id))
        elif op.kind == Op.RELEASE:
            pool.release(op.seq_id)
    return False
