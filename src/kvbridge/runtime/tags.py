"""Lease tags: proof that a lease was live, read by the decode without the prefill's serving thread.

A direct read inside vLLM waited 6-17 ms for the prefill's serving thread to grant its pin (that thread
starved of CPU by the engine's own), although the READ itself, posted beside the acquire
(``optimistic_reads``), had ended in well under a millisecond. The grant is only a proof: a lease
never comes back once it ended, so "alive when pinned" means "alive since registration", and the read
started after the parameters were issued, which the prefill does only once the blocks hold the
request's KV and stay held. Any other proof of the same fact serves as well.

Each prefill rank keeps a :class:`TagTable` in host memory registered with its NIXL agent (its address,
size and salt travel in :class:`~kvbridge.runtime.protocol.RankMeta`): one non-zero 64-bit tag per live
lease, a hash of (salt, request id, attempt), in one of the ``BUCKET`` words of the bucket the tag
names. The prefill writes the tag when it registers the lease (before ``add_request`` returns, hence
before the parameters are issued) and clears it when the lease ends, **before** the ended lease is
reported (``take_freed``), i.e. before the engine may reuse the blocks.

The decode's optimistic READ ends; only then does it READ the tag's bucket (64 bytes) from the prefill.
If the tag is there, the lease had not ended when the bucket was read, hence not when the data READ
ended (it ended before the bucket READ was posted): the blocks were live and held for the whole READ,
the bytes are trusted and the read completes without waiting for the grant (whose answer is then let
go: a late grant is released, a late refusal changes nothing). If the tag is not there (the lease ended,
is not registered yet, or its bucket was full) the read waits for the prefill's answer exactly as
before. A torn read of a word being cleared cannot show the tag: the tag's lowest bit is set, so
seeing it means its first byte was read before the clear. Stores on the prefill are ordered (the clear,
then the report, then the engine's reuse); a restarted prefill draws a new salt (and has a new NIXL
agent: READs of the old one fail).
"""
from __future__ import annotations

import hashlib
import secrets

import numpy as np

TAG_WORDS = 1 << 15   # words of a prefill rank's table (256 KiB): 4,096 buckets
BUCKET = 8            # words per bucket: one 64-byte READ checks a tag
CHECK_SLOTS = 1024    # a decode rank's bucket buffers (checks in flight at once; none free: wait for the grant)


def lease_tag(salt: int, req_id: str, attempt: int) -> int:
    """The non-zero 64-bit tag of ``attempt`` of ``req_id`` under ``salt`` (its lowest bit set)."""
    h = hashlib.blake2b(f"{req_id}\x00{int(attempt)}".encode(), digest_size=8,
                        key=int(salt).to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little") | 1


def bucket_of(tag: int, words: int) -> int:
    """Index of the first word of ``tag``'s bucket in a table of ``words`` words."""
    return ((tag >> 1) % max(1, words // BUCKET)) * BUCKET


class TagTable:
    """A prefill rank's tags of live leases (see the module docstring): :meth:`set` at registration,
    :meth:`clear` when the lease ends, before the engine hears of it."""

    def __init__(self, words: int = TAG_WORDS, salt: int | None = None) -> None:
        self.words = np.zeros(max(BUCKET, words - words % BUCKET), dtype=np.uint64)
        self.salt = secrets.randbits(63) if salt is None else int(salt)
        self._at: dict[tuple[str, int], int] = {}  # (req_id, attempt) -> its word
        self.full = 0  # registrations that found their bucket full (their readers wait for grants)

    def __len__(self) -> int:
        return len(self._at)

    def tag(self, req_id: str, attempt: int) -> int:
        return lease_tag(self.salt, req_id, attempt)

    def set(self, req_id: str, attempt: int) -> bool:
        """Write the tag of a lease just registered (False: its bucket is full, no tag)."""
        key = (req_id, int(attempt))
        if key in self._at:
            return True
        tag = self.tag(req_id, attempt)
        b = bucket_of(tag, self.words.size)
        free = np.flatnonzero(self.words[b:b + BUCKET] == 0)
        if not free.size:
            self.full += 1
            return False
        i = b + int(free[0])
        self.words[i] = np.uint64(tag)
        self._at[key] = i
        return True

    def clear(self, req_id: str, attempt: int) -> None:
        """The lease ended: clear its tag (before the ended lease is reported to the engine)."""
        i = self._at.pop((req_id, int(attempt)), None)
        if i is not None:
            self.words[i] = np.uint64(0)


def bucket_holds(words: np.ndarray, tag: int) -> bool:
    """A READ bucket (``BUCKET`` uint64 words) holds ``tag``."""
    return bool(np.any(words == np.uint64(tag)))


__all__ = ["TAG_WORDS", "BUCKET", "CHECK_SLOTS", "lease_tag", "bucket_of", "TagTable", "bucket_holds"]
