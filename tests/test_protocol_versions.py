"""Side-channel protocol versions and framing: a peer speaking another version (or not the protocol at
all) gets a typed error naming the fix, on either side, and the engines keep serving.

Every test drives real rank processes (:mod:`kvbridge.testing.procs`, one process per rank, NIXL/UCX
over host memory) or in-process ranks, checks moved bytes against the oracle (``verify``), and bounds
every wait with an explicit deadline (no pytest-timeout plugin); helpers in ``_helpers.py``, the shared
prefill/decode ``pair`` fixture (one per module) in ``conftest.py``.
"""
from __future__ import annotations

import pytest
import zmq
from _helpers import fake_prefill, inproc_decode

from kvbridge.errors import HandshakeError
from kvbridge.runtime import protocol
from kvbridge.runtime.decode import fetch_meta
from kvbridge.transport.nixl import metadata_digest, nixl_available

pytestmark = [pytest.mark.nixl, pytest.mark.skipif(not nixl_available(), reason="nixl is not installed")]


OTHER = protocol.PROTOCOL_VERSION + 1  # a version this release does not speak


def _bad_version_frames(msg, version=OTHER):
    return protocol.pack(msg, version=version)


def test_protocol_version_mismatch():
    good = protocol.pack(protocol.GetMeta("d", (0, 0), (0, 0)))
    assert isinstance(protocol.unpack(good), protocol.GetMeta)
    with pytest.raises(HandshakeError) as ei:
        protocol.unpack(protocol.pack(protocol.GetMeta("d", (0, 0), (0, 0)), version=OTHER))
    assert f"version {OTHER}" in str(ei.value) and str(protocol.PROTOCOL_VERSION) in str(ei.value)
    with pytest.raises(HandshakeError, match="magic"):
        protocol.unpack([b"HTTP", good[1], good[2]])
    with pytest.raises(HandshakeError, match="magic"):
        protocol.unpack(good[:2])
    with pytest.raises(HandshakeError, match="malformed"):
        protocol.unpack([good[0], good[1], good[2][:-3]])


def test_prefill_answers_bad_version_and_keeps_serving(pair):
    ctx = zmq.Context.instance()
    endpoint = pair.P.endpoints()[(0, 0)]
    for frames, expect in [
        (
            protocol.pack(protocol.GetMeta("dz", (0, 0), (0, 0)), version=OTHER),
            [f"version {OTHER}", f"speaks {protocol.PROTOCOL_VERSION}"],
        ),
        ([b"GET / HTTP/1.0\r\n\r\n"], ["protocol"]),
        (protocol.pack(protocol.Done("x", "dz", (0, 0), 1)), ["get_meta"]),
        (protocol.pack(protocol.GetMeta("dz", (0, 0), (0, 1))), ["(0, 0)", "(0, 1)"]),
    ]:
        s = ctx.socket(zmq.REQ)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RCVTIMEO, 5000)
        try:
            s.connect(f"tcp://{endpoint}")
            s.send_multipart(frames)
            reply = protocol.unpack(s.recv_multipart())
        finally:
            s.close(0)
        assert isinstance(reply, protocol.ErrorReply), reply
        for w in expect:
            assert w in reply.message, (w, reply.message)
    # still serving the right protocol
    meta = fetch_meta(ctx, endpoint, protocol.GetMeta("dz", (0, 0), (0, 0)), 5.0)
    assert meta.engine_id == "pm" and meta.metadata_sha256 == metadata_digest(meta.agent_metadata)


def test_decode_rejects_prefill_speaking_other_version(pair):
    real = pair.P.endpoints()
    ctx = zmq.Context.instance()

    def answer_other(frames):
        msg = protocol.unpack(frames)
        meta = fetch_meta(ctx, real[tuple(msg.prefill_rank)], msg, 5.0)
        return _bad_version_frames(meta, version=OTHER)

    with fake_prefill(answer_other) as ep, inproc_decode(pair.dl, "dv") as dec:
        with pytest.raises(HandshakeError) as ei:
            dec.handshake("pm", {r: ep for r in real})
        assert f"version {OTHER}" in str(ei.value) and "same kvbridge release" in str(ei.value)
        assert dec.stats()["peers"] == 0 and dec.metrics.failed_handshakes == 1
        dec.handshake("pm", real)  # the real endpoints still work
        assert dec.stats()["remotes"] == ["pm"]
