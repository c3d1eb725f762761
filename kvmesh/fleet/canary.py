"""The canary traffic split: which model version serves a request, the same in every router.

A request key hashes (blake2b, never Python's per-process `hash()`) to one of 10,000 buckets;
buckets below canary_percent * 100 go to the canary. Every router process and host agrees, and a
key stays on the canary as its weight grows (bucket < 100 implies bucket < 500), so a user does
not flip between versions during a rollout.
"""

from __future__ import annotations

import hashlib

SPLIT_BUCKETS = 10_000
_PERSON = b"kvmesh-canary"  # part of the split: changing it reshuffles every key


def split_bucket(request_key: str) -> int:
    """The key's bucket in [0, 10000). The 2**64 % 10000 modulo bias is below 1e-15."""
    digest = hashlib.blake2b(request_key.encode("utf-8"), digest_size=8, person=_PERSON).digest()
    return int.from_bytes(digest, "big") % SPLIT_BUCKETS


def choose_version(request_key: str, stable: str, canary: str, canary_percent: float) -> str:
    """`canary` for the keys in the first canary_percent of buckets, else `stable`.

    request_key: whatever keeps a user's requests together (a session or user id). A request
    with no key gets a random uuid from the caller (`uuid.uuid4().hex`), so it lands at random.
    An empty key is a ValueError: it would send every keyless request to the same version.
    canary_percent outside [0, 100] is a ValueError. 0 sends nothing, 100 everything to the canary.
    """
    if not request_key:
        raise ValueError("request_key must not be empty (pass a random uuid for a request without a key)")
    if not 0 <= canary_percent <= 100:
        raise ValueError(f"canary_percent must be in [0, 100], got {canary_percent}")
    return canary if split_bucket(request_key) < canary_percent * (SPLIT_BUCKETS / 100) else stable
