"""Bad input: typed errors naming what to change, raised before any byte moves (incompatible
topologies, another model or dtype, bad block ids, unknown or malformed notifications, a prefill that is
not there).

Every test drives real rank processes (:mod:`kvbridge.testing.procs`, one process per rank, NIXL/UCX
over host memory) or in-process ranks, checks moved bytes against the oracle (``verify``), and bounds
every wait with an explicit deadline (no pytest-timeout plugin); helpers in ``_helpers.py``, the shared
prefill/decode ``pair`` fixture (one per module) in ``conftest.py``.
"""
from __future__ import annotations

import time
from dataclasses import replace

import msgspec
import numpy as np
import pytest
import zmq
from _helpers import MODEL, free_port, inproc_decode, layout, until

from kvbridge.errors import HandshakeError, IncompatibleLayoutsError, LayoutError, RequestError
from kvbridge.layout import EngineLayout, ModelSpec
from kvbridge.lower import GroupBlocks
from kvbridge.models import preset
from kvbridge.runtime import protocol
from kvbridge.runtime.decode import ReadRequest, fetch_meta
from kvbridge.testing.verify import Request
from kvbridge.transport.nixl import NixlTransport, nixl_available

pytestmark = [pytest.mark.nixl, pytest.mark.skipif(not nixl_available(), reason="nixl is not installed")]


def test_incompatible_topology_is_a_layout_error():
    with pytest.raises(LayoutError) as ei:
        EngineLayout(MODEL, tp=3, role="decode")
    msg = str(ei.value)
    assert "tp=3" in msg and "4 units" in msg and "valid tp" in msg and "[1, 2, 4, 8" in msg
    with pytest.raises(LayoutError, match="pp=5"):
        EngineLayout(MODEL, pp=5)  # 4 layers
    with pytest.raises(LayoutError, match="block_size"):
        EngineLayout(MODEL, block_size=0)


def _float16(model: ModelSpec) -> ModelSpec:
    return ModelSpec(model.name, model.num_layers, tuple(replace(g, dtype="float16") for g in model.groups))


@pytest.mark.parametrize("other, words", [
    (preset("tiny-mla"), ["tiny-mla", "tiny-dense", "same model"]),
    (_float16(MODEL), ["bfloat16", "float16", "dtype"]),
])
def test_handshake_with_other_model_or_dtype_is_refused(pair, other, words):
    before = pair.D.call_all("stats")
    dl = layout("decode", 1, 64, model=other)
    with inproc_decode(dl, "dx") as dec:
        with pytest.raises(IncompatibleLayoutsError) as ei:
            dec.handshake("pm", pair.P.endpoints())
        for w in words:
            assert w in str(ei.value), (w, str(ei.value))
        s = dec.stats()
        assert s["remotes"] == [] and s["peers"] == 0  # nothing was added to NIXL
        assert s["nixl"]["handles_created"] == 0 and s["metrics"]["failed_handshakes"] == 1
    # the prefill engine and the shared decode are unaffected
    assert pair.D.call_all("stats") == before
    pair.roundtrip(pair.jobs.make("pm", 2))
    assert pair.verify()["mismatched_bytes"] == 0


def test_bad_block_ids_and_too_many_blocks(pair):
    D = next(iter(pair.D.workers.values()))
    j = pair.jobs.make("pm", 1, lengths=[24], prefix_p=0.0, tag="bad")[0]
    r = j.req
    before = D.call("stats")
    cases = []
    pb = dict(r.prefill_blocks)
    pb["full"] = GroupBlocks(np.append(r.prefill_blocks["full"].block_ids[:-1], pair.pl.num_blocks + 5))
    cases.append((replace(r, prefill_blocks=pb), ["prefill block ids", str(pair.pl.num_blocks + 5), "out of range"]))
    db = dict(r.decode_blocks)
    db["full"] = GroupBlocks(np.append(r.decode_blocks["full"].block_ids[:-1], -1))
    cases.append((replace(r, decode_blocks=db), ["decode block ids", "[-1]", "out of range"]))
    # the prefill sent blocks for the first 8 tokens only; the decode asks for all of them
    n = 20
    pb = {"full": GroupBlocks(r.prefill_blocks["full"].block_ids[:2])}
    db = {"full": GroupBlocks(r.decode_blocks["full"].block_ids[:5])}
    cases.append((Request(r.req_id, n, pb, db), ["more blocks than the prefill sent", "[0, 8)"]))
    # the decode allocated more blocks than the request has tokens
    db = {"full": GroupBlocks(np.concatenate([r.decode_blocks["full"].block_ids, [0, 1, 2]]))}
    cases.append((replace(r, decode_blocks=db), ["allocate"]))
    cases.append((replace(r, decode_blocks={}), ["no decode block ids", "'full'"]))
    for i, (bad, words) in enumerate(cases):
        rr = ReadRequest(f"bad-{i}", "pm", bad.num_tokens, bad.prefill_blocks, bad.decode_blocks)
        with pytest.raises(RequestError) as ei:
            D.call("start", rr)
        for w in words:
            assert w in str(ei.value), (w, str(ei.value))
        errs = D.call("start_many", [rr])
        assert list(errs) == [rr.req_id] and errs[rr.req_id].startswith("RequestError")
    after = D.call("stats")
    assert after["metrics"]["transfers"] == before["metrics"]["transfers"]  # nothing was posted
    assert after["nixl"]["handles_created"] == before["nixl"]["handles_created"]
    assert after["inflight"] == 0
    pair.roundtrip([j])  # the same rank still serves the valid version of the request
    assert pair.verify()["mismatched_bytes"] == 0


def test_unknown_and_malformed_notifications_are_counted(pair):
    def unknown():
        return {r: s["metrics"]["unknown_notifications"] for r, s in pair.P.call_all("stats").items()}

    before = unknown()
    ghost = pair.jobs.make("pm", 1, tag="ghost")[0]  # never published on the prefill
    pair.D.call_all("abort", ghost.rid, readers_of=ghost.read())
    until(lambda: all(unknown()[r] >= before[r] + 1 for r in before), 10, "unknown notifications")
    # malformed notifications, from an agent the prefill never heard of
    ctx = zmq.Context.instance()
    t = NixlTransport("rel-stranger")
    try:
        for r, ep in pair.P.endpoints().items():
            meta = fetch_meta(ctx, ep, protocol.GetMeta("stranger", (0, 0), r), 5.0)
            name = t.add_peer(meta.agent_metadata, meta.metadata_sha256)
            t.send_notif(name, b"garbage")
            t.send_notif(name, protocol.MAGIC + b"\xc1\xc1")
            t.send_notif(name, protocol.MAGIC + msgspec.msgpack.encode(protocol.ErrorReply("not a Done")))
    finally:
        t.close()
    until(lambda: all(unknown()[r] == before[r] + 4 for r in before), 10, "malformed notifications")
    assert all(w.proc.is_alive() for w in pair.P.workers.values())
    pair.roundtrip(pair.jobs.make("pm", 2))  # nothing crashed: the engines still move bytes
    assert pair.verify()["mismatched_bytes"] == 0
    assert unknown() == {r: before[r] + 4 for r in before}


def test_handshake_to_nobody_times_out():
    timeout = 0.5
    with inproc_decode(layout("decode", 1, 16), "dn", handshake_timeout_s=timeout) as dec:
        port = free_port()
        t0 = time.monotonic()
        with pytest.raises(HandshakeError) as ei:
            dec.handshake("ghost", {(0, 0): f"127.0.0.1:{port}"})
        elapsed = time.monotonic() - t0
        assert elapsed < timeout + 2, elapsed
        assert str(port) in str(ei.value) and "0.5 s" in str(ei.value) and "running" in str(ei.value)
        with pytest.raises(HandshakeError, match=r"no endpoint given for prefill rank \(0, 0\)"):
            dec.handshake("ghost", {(0, 1): f"127.0.0.1:{port}"})
        assert dec.metrics.failed_handshakes == 2 and dec.stats()["remotes"] == []
        with pytest.raises(HandshakeError, match="no handshake with prefill engine 'ghost'"):
            dec.start(ReadRequest("x", "ghost", 1, {}, {}))
