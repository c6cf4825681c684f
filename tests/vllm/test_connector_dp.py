"""Data parallelism: several DP ranks of a prefill engine on one host, each its own vLLM engine core
(``engine_id`` + ``_dp{rank}``, ``data_parallel_index``), all started from one ``--kv-transfer-config``.
Each DP rank binds its own side-channel port range (one rule, :func:`rank_port` / :func:`dp_port_base`), and
its kv_transfer_params name that DP rank's endpoint, so decode DP ranks read from the exact prefill DP rank.

With vLLM 0.33's real Scheduler (scheduler side) and vLLM's own KV-cache tensors, one process per rank over
NIXL (worker side, ``worker_harness.run_dp``)."""
from __future__ import annotations

import json
import socket

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

from sched_utils import TINY_LLAMA, make_request, make_scheduler, make_vllm_config, step  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvbridge.integrations.vllm import (  # noqa: E402
    ConnectorConfig,
    dp_engine_id,
    dp_port_base,
    engine_endpoints,
    rank_port,
)
from kvbridge.integrations.vllm.config import side_channel_host  # noqa: E402

BLOCK = 16
PROMPT = list(range(3, 43))


@pytest.mark.parametrize("pcp", [1, 2])
@pytest.mark.parametrize("tp", [1, 2, 3, 8])
@pytest.mark.parametrize("pp", [1, 2, 4])
@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_every_worker_of_every_dp_rank_gets_its_own_port(dp, pp, tp, pcp):
    """The port every (DP rank, pp, pcp, tp) worker binds, from one base: all distinct, packed in
    [base, base + dp * pp * pcp * tp), and what a decode derives from a DP rank's params is what that rank
    bound (a stage's workers are kvbridge ranks r = pcp_rank * tp + tp_rank)."""
    base = 7000
    bound = {}
    for d in range(dp):
        for a in range(pp):
            for b in range(tp * pcp):
                bound[(d, a, b)] = rank_port(dp_port_base(base, d, tp, pp, pcp), (a, b), tp, pcp)
    assert len(set(bound.values())) == dp * pp * pcp * tp
    assert set(bound.values()) == set(range(base, base + dp * pp * pcp * tp))
    for d in range(dp):
        derived = engine_endpoints("h", dp_port_base(base, d, tp, pp, pcp), tp, pp, pcp)
        assert derived == {(a, b): f"h:{bound[(d, a, b)]}" for a in range(pp) for b in range(tp * pcp)}


def test_dp_engine_id_follows_vllm_and_is_idempotent():
    assert dp_engine_id("prefill", 1, 0) == "prefill"
    assert dp_engine_id("prefill", 4, 2) == "prefill_dp2"
    assert dp_engine_id("prefill_dp2", 4, 2) == "prefill_dp2"  # vLLM's engine core already appended it


def test_side_channel_host_per_node():
    """The env var (set per node) wins over the static config value; vLLM's NIXL variable is the fallback;
    ``"auto"`` is the address vLLM discovers for this node."""
    assert side_channel_host({}, {}) == "127.0.0.1"
    assert side_channel_host({}, {"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.9"}) == "10.0.0.9"
    assert (
        side_channel_host({"side_channel_host": "10.0.0.1"}, {"VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.9"}) == "10.0.0.1"
    )
    assert (
        side_channel_host({"side_channel_host": "10.0.0.1"}, {"KVBRIDGE_SIDE_CHANNEL_HOST": "10.0.0.2"}) == "10.0.0.2"
    )
    auto = side_channel_host({"side_channel_host": "auto"}, {})
    socket.inet_pton(socket.AF_INET6 if ":" in auto else socket.AF_INET, auto)  # an address, not a name


def _dp_engine(tmp_path, name, dp, index, role="kv_both", tp=1, port=7000, host="10.1.2.3"):
    """A scheduler of DP rank ``index`` of ``dp``, its config as vLLM's engine core sets it
    (vllm/v1/engine/core.py: ``engine_id`` + ``_dp{rank}``, ``data_parallel_index``)."""
    cfg = make_vllm_config(
        tmp_path / f"{name}{index}", TINY_LLAMA, block_size=BLOCK,
        kv_transfer_config=dict(kv_connector="KVBridgeConnector", kv_connector_module_path="kvbridge.integrations.vllm",
                                kv_role=role, engine_id=f"engine-{name}",
                                kv_connector_extra_config={"side_channel_host": host, "side_channel_port": port}))
    pc = cfg.parallel_config
    pc.data_parallel_size, pc.data_parallel_rank, pc.data_parallel_index = dp, index, index
    pc.tensor_parallel_size = tp
    cfg.kv_transfer_config.engine_id = f"{cfg.kv_transfer_config.engine_id}_dp{index}"
    return make_scheduler(cfg, num_blocks=64)


def test_prefill_dp_ranks_name_their_own_endpoint_and_decode_dp_ranks_read_the_exact_one(tmp_path):
    """Prefill DP ranks 0..3 (TP2 each, one extra config: side_channel_port 7000) -> decode DP ranks 0..1,
    on vLLM's real Scheduler: each prefill's params carry its ``_dp{rank}`` engine id and its own port
    base; each decode DP rank's worker metadata names exactly that endpoint."""
    P = [_dp_engine(tmp_path, "p", 4, i, tp=2) for i in range(4)]
    D = [_dp_engine(tmp_path, "d", 2, i, role="kv_consumer") for i in range(2)]
    params = []
    for i, sched in enumerate(P):
        req = make_request(f"req-P{i}", PROMPT, max_tokens=1, kv_transfer_params={"do_remote_decode": True},
                           block_size=BLOCK)
        sched.add_request(req)
        _, outs = step(sched)
        (eco,) = [o for eo in outs.values() for o in eo.outputs]
        p = json.loads(json.dumps(eco.kv_transfer_params))
        assert p["remote_engine_id"] == f"engine-p_dp{i}" and p["remote_dp_rank"] == i
        assert (p["remote_host"], p["remote_port"], p["remote_tp_size"]) == ("10.1.2.3", 7000 + 2 * i, 2)
        params.append(p)
    # the ranks of the 4 DP ranks: 8 distinct ports from one base
    ports = [int(h.rsplit(":", 1)[1]) for p in params
             for h in engine_endpoints(p["remote_host"], p["remote_port"], p["remote_tp_size"], 1).values()]
    assert sorted(ports) == list(range(7000, 7008))
    for i, p in enumerate(params):
        d = D[i % 2]
        req = make_request(f"req-D{i}", PROMPT, max_tokens=2, kv_transfer_params=p, block_size=BLOCK)
        d.add_request(req)
        so, _ = step(d)
        assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        r = so.kv_connector_metadata.recv[f"req-D{i}"]
        assert (r.remote["remote_engine_id"], r.remote["remote_port"]) == (f"engine-p_dp{i}", 7000 + 2 * i)
        assert engine_endpoints(r.remote["remote_host"], r.remote["remote_port"], 2, 1) == {
            (0, 0): f"10.1.2.3:{7000 + 2 * i}", (0, 1): f"10.1.2.3:{7001 + 2 * i}"}
    for d in D:
        assert d.connector.engine_id.startswith("engine-d_dp")


def test_a_worker_binds_its_dp_ranks_port():
    """ConnectorConfig.endpoint: (host, port) worker (pp, tp) of DP rank 3 binds, from the shared base."""
    import tempfile

    cfg = make_vllm_config(tempfile.mkdtemp(), TINY_LLAMA, block_size=BLOCK, kv_transfer_config=dict(
        kv_connector="KVBridgeConnector", kv_connector_module_path="kvbridge.integrations.vllm",
        kv_role="kv_producer", engine_id="p", kv_connector_extra_config={"side_channel_port": 9000}))
    pc = cfg.parallel_config
    pc.data_parallel_size, pc.data_parallel_index, pc.tensor_parallel_size, pc.pipeline_parallel_size = 4, 3, 2, 2
    c = ConnectorConfig.from_vllm(cfg, environ={})
    assert c.engine_id == "p_dp3" and c.port == 9000 + 3 * 4
    assert c.endpoint((1, 1)) == ("127.0.0.1", 9000 + 3 * 4 + 1 * 2 + 1)


def test_decode_timeouts_from_the_extra_config_reach_the_endpoint():
    """The decode's time bounds, ``connect_timeout_s`` (the whole background handshake) among them, come from
    ``kv_connector_extra_config``, typed; keys that are not decode options (``lease_s``) are not passed."""
    import tempfile

    extra = {"connect_timeout_s": "240", "stage_timeout_s": 90, "handshake_timeout_s": 7.5, "lease_s": 3}
    cfg = make_vllm_config(tempfile.mkdtemp(), TINY_LLAMA, block_size=BLOCK, kv_transfer_config=dict(
        kv_connector="KVBridgeConnector", kv_connector_module_path="kvbridge.integrations.vllm",
        kv_role="kv_consumer", engine_id="d", kv_connector_extra_config=extra))
    c = ConnectorConfig.from_vllm(cfg, environ={})
    from kvbridge.integrations.vllm.config import VLLM_DECODE_DEFAULTS
    from kvbridge.runtime.config import DecodeConfig

    # typed, the connector's own defaults (register_grace_s, tag_checks, inline_post_bytes) kept; lease_s is the
    # prefill's
    assert c.decode == DecodeConfig(**{**VLLM_DECODE_DEFAULTS, "connect_timeout_s": 240.0, "stage_timeout_s": 90.0,
                                       "handshake_timeout_s": 7.5})
    assert c.decode.tag_checks and c.decode.inline_post_bytes == 64 << 20 and c.decode.register_grace_s == 30.0
    assert c.prefill.lease_s == c.lease_s == 3.0


# ---------------------------------------------------------------------- worker side, over NIXL
@pytest.mark.parametrize("p_tp", [1, 2], ids=["prefill-dp4-tp1", "prefill-dp2-tp2"])
def test_prefill_dp_ranks_on_one_host_to_decode_dp_ranks_byte_exact(p_tp):
    """Prefill DP ranks on one host (DP4 x TP1, or DP2 x TP2), every worker started with the same extra
    config, each binding its own port; decode DP ranks 0..1 read requests from every prefill DP rank, the
    endpoints taken from each prefill DP rank's own kv_transfer_params. Every byte checked; each prefill
    DP rank frees exactly its own requests."""
    pytest.importorskip("nixl._api")
    pytest.importorskip("vllm.v1.core.kv_cache_planning")
    from worker_harness import Side, llama, run_dp

    p_dp = 4 // p_tp
    reqs = [(40, i % p_dp, i % 2) for i in range(4)] + [(70, (i + 1) % p_dp, i % 2) for i in range(2)]
    r = run_dp(llama(2), Side(p_tp, 1, 16), Side(1, 1, 16), p_dp=p_dp, d_dp=2, requests=reqs)
    print(f"DP{p_dp}xTP{p_tp} -> DP2: done {r.done}, sent {r.sent}, {r.checked} values checked")
    assert r.failed == []
    for ddp in range(2):
        assert r.done[ddp] == sorted(f"dec-req-{no}" for no, (_, _, d) in enumerate(reqs, 1) if d == ddp)
    for pdp in range(p_dp):
        assert r.sent[pdp] == sorted(f"req-{no}" for no, (_, p, _) in enumerate(reqs, 1) if p == pdp)
    assert r.checked > 0 and r.bad == 0 and r.untouched_bad == 0
    assert {p["remote_engine_id"] for p in r.params.values()} == {f"prefill-e_dp{i}" for i in range(p_dp)}
