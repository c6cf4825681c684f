"""Corrupted or inconsistent rank metadata at handshake: NIXL agent metadata corrupted at rest or in
transit, rank metadata that disagrees with itself or with the other ranks of its engine. The handshake
fails typed, leaves no half-added peer, and a correct handshake afterwards works.

Every test drives real rank processes (:mod:`kvbridge.testing.procs`, one process per rank, NIXL/UCX
over host memory) or in-process ranks, checks moved bytes against the oracle (``verify``), and bounds
every wait with an explicit deadline (no pytest-timeout plugin); helpers in ``_helpers.py``, the shared
prefill/decode ``pair`` fixture (one per module) in ``conftest.py``.
"""
from __future__ import annotations

import json
from dataclasses import replace

import msgspec
import numpy as np
import pytest
import zmq
from _helpers import BS, Jobs, fake_prefill, inproc_decode, layout, publish, served, until, wait_freed

from kvbridge.errors import HandshakeError
from kvbridge.runtime import protocol
from kvbridge.runtime.decode import fetch_meta
from kvbridge.runtime.prefill import PrefillRank
from kvbridge.testing.engine import default_memory
from kvbridge.testing.procs import fill_rank, verify_rank
from kvbridge.transport.nixl import NixlTransport, metadata_digest, nixl_available

pytestmark = [pytest.mark.nixl, pytest.mark.skipif(not nixl_available(), reason="nixl is not installed")]


def test_corrupted_agent_metadata_is_refused_then_correct_one_accepted():
    """NixlTransport.add_peer: a corrupted or truncated blob fails its sha256 before NIXL sees it
    (a corrupted-but-parseable blob would poison the peer name in NIXL for good); the correct
    metadata is accepted afterwards and a read works (two agents in this process)."""
    a, b = NixlTransport("rel-meta-a"), NixlTransport("rel-meta-b")
    try:
        src = np.arange(1 << 16, dtype=np.uint64).view(np.uint8).copy()
        dst = np.zeros_like(src)
        abase, bbase = a.register(src), b.register(dst)
        md = a.metadata()
        digest = metadata_digest(md)
        flipped = bytearray(md)
        flipped[len(md) // 2] ^= 0xFF
        for bad in (bytes(flipped), md[: len(md) // 2], md[:-1], b"", md + b"\0"):
            with pytest.raises(HandshakeError, match="checksum"):
                b.add_peer(bad, digest)
        for garbage in (b"not nixl metadata", md[:40]):  # no digest: NIXL itself refuses, typed
            with pytest.raises(HandshakeError, match="NIXL refused"):
                b.add_peer(garbage)
        assert b.peers == frozenset() and b.stats.peers_added == 0
        name = b.add_peer(md, digest)
        assert name == "rel-meta-a" and b.peers == {name}
        n = 4096
        offs = np.arange(0, src.size, n, dtype=np.int64)[::-1].copy()  # reversed blocks
        x = b.read(name, abase + offs, bbase + np.arange(offs.size, dtype=np.int64) * n,
                   np.full(offs.size, n, dtype=np.int64), b"tag-1")
        until(lambda: b.check(x) == "DONE", 10, "in-process read")
        b.release(x)
        assert np.array_equal(dst.reshape(-1, n), src.reshape(-1, n)[::-1])
        notifs = until(lambda: a.get_notifs(), 5, "notification")
        assert notifs == {"rel-meta-b": [b"tag-1"]}
        assert b.live_handles() == 0
    finally:
        b.close()
        a.close()
    for t in (a, b):
        assert t.stats.regions_registered == t.stats.regions_deregistered == 1
        assert t.stats.peers_added == t.stats.peers_removed


def test_handshake_with_corrupted_metadata_in_transit(pair):
    """A side channel that corrupts the agent metadata (but forwards the real checksum): the decode
    refuses with a HandshakeError, adds no peer, and a later correct handshake works and moves bytes."""
    real = pair.P.endpoints()
    ctx = zmq.Context.instance()

    def corrupt(frames):
        msg = protocol.unpack(frames)
        meta = fetch_meta(ctx, real[tuple(msg.prefill_rank)], msg, 5.0)
        md = bytearray(meta.agent_metadata)
        md[len(md) // 2] ^= 0x5A
        return protocol.pack(msgspec.structs.replace(meta, agent_metadata=bytes(md)))

    jobs = pair.jobs.make("pm", 3, tag="cm")
    exp = publish(pair.P, jobs)
    with fake_prefill(corrupt) as ep, inproc_decode(pair.dl, "dc") as dec:
        with pytest.raises(HandshakeError, match="checksum"):
            dec.handshake("pm", {r: ep for r in real})
        assert dec.stats()["peers"] == 0 and dec.stats()["remotes"] == []
        dec.handshake("pm", real)
        for j in jobs:
            dec.start(j.read(exp[j.rid]))
        done, failed = dec.wait(20)
        assert set(done) == {j.rid for j in jobs} and not failed
        assert verify_rank(dec, [(j.num, j.read()) for j in jobs])["mismatched_bytes"] == 0
    wait_freed(pair.P, {j.rid for j in jobs})


def _mutate_layout_dims(meta):
    lay = json.loads(json.dumps(meta.layout))
    lay["model"]["groups"][0]["head_dim"] *= 2  # a different model behind the same fingerprint
    return msgspec.structs.replace(meta, layout=lay)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda m: msgspec.structs.replace(m, engine_id="other"), "is engine 'other', expected 'pm'"),
        (lambda m: msgspec.structs.replace(m, rank=(1, 1)), r"is rank \(1, 1\)"),
        (_mutate_layout_dims, "fingerprint"),
        (
            lambda m: msgspec.structs.replace(
                m, memory={**m.memory, "allocations": [[a, 1, d] for a, _, d in m.memory["allocations"]]}
            ),
            "not inside one registered memory region",
        ),
        (lambda m: msgspec.structs.replace(m, metadata_sha256="0" * 64), "checksum"),
        (lambda m: msgspec.structs.replace(m, layout={"model": {}}), "invalid layout"),
    ],
    ids=["engine-id", "rank", "layout-vs-fingerprint", "buffer-size", "digest", "malformed-layout"],
)
def test_handshake_rejects_inconsistent_rank_metadata(pair, mutate, match):
    real = pair.P.endpoints()
    ctx = zmq.Context.instance()

    def answer(frames):
        msg = protocol.unpack(frames)
        return protocol.pack(mutate(fetch_meta(ctx, real[tuple(msg.prefill_rank)], msg, 5.0)))

    with fake_prefill(answer) as ep, inproc_decode(pair.dl, "di") as dec:
        with pytest.raises(HandshakeError, match=match):
            dec.handshake("pm", {r: ep for r in real})
        s = dec.stats()
        assert s["peers"] == 0 and s["remotes"] == [] and s["metrics"]["failed_handshakes"] == 1


def test_failed_handshake_leaves_no_half_added_peer():
    """Rank (0, 1) of a two-rank prefill engine disagrees with rank (0, 0) about the layout: the handshake
    fails after rank (0, 0)'s agent was added, and that agent is removed again; once rank (0, 1) is
    fixed, the same decode rank handshakes and reads normally."""
    pl, dl = layout("prefill", 2, 64), layout("decode", 1, 64)
    jobs = Jobs(dl, seed=14)
    jobs.engine("ph", pl)
    pres = [PrefillRank(pl, (0, r), memory=default_memory(pl, (0, r)), engine_id="ph") for r in range(2)]
    endpoints = {(0, r): f"127.0.0.1:{p.port}" for r, p in enumerate(pres)}
    try:
        with served(pres[0]) as lock0, served(pres[1]) as lock1, inproc_decode(dl, "dh") as dec:
            with lock1:
                pres[1].engine = replace(pl, block_size=BS * 2)  # a different layout than rank (0, 0)
            with pytest.raises(HandshakeError, match="different layout"):
                dec.handshake("ph", endpoints)
            s = dec.transport.stats
            assert dec.transport.peers == frozenset() and s.peers_added == s.peers_removed == 1
            assert "ph" not in dec.remotes
            with lock1:
                pres[1].engine = pl
            dec.handshake("ph", endpoints)
            assert len(dec.transport.peers) == 2
            (j,) = jobs.make("ph", 1, lengths=[40])
            with lock0, lock1:
                for p in pres:
                    fill_rank(p, j.num, j.req.num_tokens, j.req.prefill_blocks)
                    p.add_request(j.rid, j.req.prefill_blocks, attempt=j.attempt)
            dec.start(j.read())
            done, failed = dec.wait(20)
            assert done == [j.rid] and not failed
            assert verify_rank(dec, [(j.num, j.read())])["mismatched_bytes"] == 0
    finally:
        for p in pres:
            p.close()
