"""The kvcache's checks on an ApplyRequest, before it allocates or applies anything, and replay
of operations that do not fit the pool (a divergence, never a crash)."""

import pytest

from kvmesh.params import MAX_REQUEST_ID_CHARS, InvalidRequest
from kvmesh.services.kvcache.pages import PagePool
from kvmesh.services.kvcache.replica import MAX_OPS_PER_APPLY, Op, RecordingPagePool, apply_ops, check_apply
from kvmesh.v1 import kvcache_pb2

CAP = 1000


def request(**fields):
    return kvcache_pb2.ApplyRequest(**{"worker_id": "w", "epoch": 1, "num_pages": 64, "page_size": 16, **fields})


@pytest.mark.parametrize("fields, field, limit", [
    (dict(num_pages=5_000_000), "num_pages", "must be in [1, 1000] (max_pages_per_worker), got 5000000"),
    (dict(num_pages=0), "num_pages", "must be in [1, 1000]"),
    (dict(page_size=0), "page_size", "must be in [1, 65536]"),
    (dict(ops=[Op(kind=Op.RELEASE, seq_id="s")] * (MAX_OPS_PER_APPLY + 1)), "ops", f"over the limit of {MAX_OPS_PER_APPLY}"),
    (dict(ops=[Op(kind=Op.GROW, seq_id="s"), Op(kind=Op.OPEN, seq_id="t", page_ids=[3, 64])]), "ops[1].page_ids",
     "page 64 is outside the pool [0, 64)"),
    (dict(ops=[Op(kind=Op.OPEN, seq_id="s" * 10_000)]), "ops[0].seq_id", f"over the limit of {MAX_REQUEST_ID_CHARS}"),
])
def test_an_apply_no_replica_could_have_recorded_is_refused_naming_the_field_and_the_limit(fields, field, limit):
    with pytest.raises(InvalidRequest) as err:
        check_apply(request(**fields), CAP)
    assert err.value.field == field and limit in str(err.value)


def test_what_a_recording_pool_records_passes_the_check_and_replays_identically():
    recorder = RecordingPagePool(64, 16)
    recorder.open("a", [])
    recorder.grow("a", 40)
    recorder.commit("a", list(range(40)), 40)
    recorder.release("a")
    ops = recorder.drain()
    check_apply(request(ops=ops), CAP)
    replica = PagePool(64, 16)
    assert apply_ops(replica, ops) is False
    assert replica.stats() == recorder.stats()


@pytest.mark.parametrize("ops", [
    [Op(kind=Op.GROW, seq_id="unknown", num_tokens=16, page_ids=[0])],
    [Op(kind=Op.COMMIT, seq_id="unknown", num_tokens=16, token_ids=list(range(16)))],
    [Op(kind=Op.OPEN, seq_id="s"), Op(kind=Op.OPEN, seq_id="s")],
    [Op(kind=Op.OPEN, seq_id="s"), Op(kind=Op.GROW, seq_id="s", num_tokens=2**32 - 1)],
])
def test_operations_that_do_not_fit_the_pool_are_a_divergence_not_a_crash(ops):
    assert apply_ops(PagePool(64, 16), ops) is True
