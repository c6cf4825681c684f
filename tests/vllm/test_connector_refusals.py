"""What the connector refuses, by name, instead of mis-moving KV: context-parallel sizes vLLM cannot form
(context parallelism itself is supported), sleep mode,
unavailable NIXL backends, KV-cache spec kinds it does not move, a decode whose speculative config differs
from the prefill's."""
from __future__ import annotations

import dataclasses
import tempfile

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

from sched_utils import TINY_LLAMA, make_vllm_config  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from kvbridge.integrations.vllm import (  # noqa: E402
    ConnectorConfig,
    ContextParallelUnsupported,
    KVBridgeConnector,
    VLLMConfigError,
)
from kvbridge.integrations.vllm_cp import VLLMContextParallelError  # noqa: E402


def _cfg(extra=None, role="kv_both"):
    return make_vllm_config(tempfile.mkdtemp(), TINY_LLAMA, block_size=16, kv_transfer_config=dict(
        kv_connector="KVBridgeConnector", kv_connector_module_path="kvbridge.integrations.vllm", kv_role=role,
        engine_id="e", kv_connector_extra_config=extra or {}))


# ---------------------------------------------------------------------- context parallelism
# (supported; what vLLM's groups cannot form, or kvbridge cannot move, is refused by name)
@pytest.mark.parametrize("setting", ["prefill_context_parallel_size", "decode_context_parallel_size"])
@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_a_context_parallel_engine_is_supported(setting, role):
    """PCP / DCP engines start with the connector (the sizes read from vLLM's config); the worker builds its
    geometry in register_kv_caches (tests/vllm/test_connector_cp.py moves bytes and runs vLLM's Scheduler
    with DCP)."""
    cfg = _cfg()
    cfg.parallel_config.tensor_parallel_size = 2
    setattr(cfg.parallel_config, setting, 2)
    conn = KVBridgeConnector(cfg, role, None)
    c = ConnectorConfig.from_vllm(cfg, environ={})
    assert (c.pcp, c.dcp) == ((2, 1) if setting.startswith("prefill") else (1, 2))
    assert isinstance(conn, KVBridgeConnector)


def test_a_dcp_size_vllm_cannot_form_is_refused_naming_it():
    """dcp must divide tp without PCP (vLLM's DCP groups reuse the TP ranks): typed, the setting named."""
    cfg = _cfg()
    cfg.parallel_config.tensor_parallel_size = 4
    cfg.parallel_config.decode_context_parallel_size = 3
    with pytest.raises(VLLMContextParallelError, match="decode_context_parallel_size=3"):
        KVBridgeConnector(cfg, KVConnectorRole.SCHEDULER, None)
    assert issubclass(ContextParallelUnsupported, VLLMConfigError)


# ---------------------------------------------------------------------- sleep mode
def test_sleep_mode_is_refused():
    """Sleep mode frees and re-allocates the KV memory kvbridge registered with NIXL: the connector says it
    does not support it, so vLLM refuses ``--enable-sleep-mode`` with it (vLLM's own check)."""
    cfg = _cfg()
    assert KVBridgeConnector.supports_sleep_mode(cfg.kv_transfer_config) is False
    cfg.model_config.enable_sleep_mode = True  # (the CPU platform refuses it earlier, in ModelConfig)
    with pytest.raises(ValueError, match="KVBridgeConnector does not support sleep mode"):
        cfg._verify_kv_transfer_compat()


# ---------------------------------------------------------------------- NIXL backends and threads
def test_backends_and_num_threads_are_read_from_the_extra_config():
    assert ConnectorConfig.from_vllm(_cfg(), environ={}).backends == ("UCX",)
    c = ConnectorConfig.from_vllm(_cfg({"backends": ["LIBFABRIC"], "num_threads": 8}), environ={})
    assert (c.backends, c.num_threads) == (("LIBFABRIC",), 8)
    for bad in ([], [""], 3):
        with pytest.raises(VLLMConfigError, match="backends"):
            ConnectorConfig.from_vllm(_cfg({"backends": bad}), environ={})
    with pytest.raises(VLLMConfigError, match="num_threads"):
        ConnectorConfig.from_vllm(_cfg({"num_threads": 0}), environ={})


def test_endpoint_options_from_the_extra_config_are_typed_and_checked():
    """Keys naming PrefillConfig / DecodeConfig options configure the endpoints (converted, checked, named
    when bad); lease_grace_s is register_grace_s under another name; unknown keys are left to subclasses."""
    c = ConnectorConfig.from_vllm(_cfg({"lease_s": "12", "pin_s": 50, "lease_grace_s": 1.5, "transfer_mode": "staged",
                                        "staging_bytes": 0, "corrupt": True}), environ={})
    assert (c.prefill.lease_s, c.prefill.pin_s, c.prefill.staging_bytes) == (12.0, 50.0, 0)
    assert (c.decode.register_grace_s, c.decode.transfer_mode, c.decode.staging_bytes) == (1.5, "staged", 0)
    assert ConnectorConfig.from_vllm(_cfg(), environ={}).decode.register_grace_s == 30.0  # the connector's default
    d = ConnectorConfig.from_vllm(_cfg(), environ={}).decode  # the connector's tag checks and inline posts: on
    assert (d.tag_checks, d.inline_post_bytes) == (True, 64 << 20)
    off = ConnectorConfig.from_vllm(_cfg({"tag_checks": "false", "inline_post_bytes": "0"}), environ={}).decode
    assert (off.tag_checks, off.inline_post_bytes) == (False, 0)  # and off from the extra config, typed
    assert c.prefill_config((0, 0)) == dataclasses.replace(c.prefill, host=c.host, port=c.port)
    for extra, words in (({"lease_s": "soon"}, "PrefillConfig.lease_s must be float"),
                         ({"transfer_mode": "fast"}, "transfer_mode must be one of auto, direct, staged"),
                         ({"lease_grace_s": 1, "register_grace_s": 2}, "both lease_grace_s and register_grace_s")):
        with pytest.raises(VLLMConfigError, match=words):
            ConnectorConfig.from_vllm(_cfg(extra), environ={})


def test_each_option_default_is_written_once():
    """The endpoint options' defaults are their config classes' but for the one vLLM override table; an alias
    names its option (no default of its own); the prefill server's poll period is a PrefillConfig option."""
    from kvbridge import DecodeConfig, PrefillConfig
    from kvbridge.integrations.vllm.config import OPTION_ALIASES, VLLM_DECODE_DEFAULTS, endpoint_configs
    p, d = endpoint_configs({})
    assert p == PrefillConfig() and d == DecodeConfig(**VLLM_DECODE_DEFAULTS)
    assert ConnectorConfig.from_vllm(_cfg(), environ={}).decode == d
    assert all(name in DecodeConfig.__dataclass_fields__ for name in OPTION_ALIASES.values())
    assert endpoint_configs({"lease_grace_s": "0.5"})[1].register_grace_s == 0.5
    assert endpoint_configs({"poll_s": "0.01"})[0].poll_s == 0.01


def test_transfer_params_round_trip_and_refuse_bad_values():
    from kvbridge.errors import RequestError
    from kvbridge.integrations.vllm.config import TransferParams

    p = TransferParams(do_remote_prefill=True, remote_engine_id="e_dp1", remote_host="10.0.0.2", remote_port=7002,
                       remote_block_ids=[[1, 2], [3]], remote_request_id="r", remote_num_tokens=40, remote_tp_size=2,
                       remote_attempt=5)
    d = p.to_dict()
    assert TransferParams.from_dict({**d, "_kvbridge_truncated": True, "other": 1}) == p
    assert TransferParams.from_dict({**d, "remote_port": "7002"}).remote_port == 7002
    assert p.readable and not TransferParams().readable
    assert p.endpoints() == {(0, 0): "10.0.0.2:7002", (0, 1): "10.0.0.2:7003"}
    with pytest.raises(RequestError, match="remote_block_ids"):
        TransferParams.from_dict({**d, "remote_block_ids": "1,2"})
    with pytest.raises(RequestError, match="remote_tp_size"):  # the error names the bad key
        TransferParams.from_dict({**d, "remote_tp_size": None})
    # vLLM's flags, as a router sends them: truthiness (null is false)
    assert TransferParams.from_dict({"do_remote_decode": 1, "do_remote_prefill": None}) == TransferParams(
        do_remote_decode=True)


def _build_in_child(extra, role, model=None, side=None):
    """Build a worker-role connector in a forked child (a NIXL agent in the test process would be inherited
    by the rank processes other tests fork); returns the child's exception type name and message."""
    import multiprocessing as mp

    from worker_harness import Side, build_worker, llama

    def child(pipe):
        try:
            conn, *_ = build_worker(model or llama(2), side or Side(1, 1, 16), (0, 0), role, "e", 0,
                                    tempfile.mkdtemp(), extra=extra)
            conn.shutdown()
            pipe.send(("ok", ""))
        except Exception as e:  # noqa: BLE001
            pipe.send((type(e).__name__, str(e)))

    ctx = mp.get_context("fork")
    a, b = ctx.Pipe()
    p = ctx.Process(target=child, args=(b,), daemon=True)
    p.start()
    assert a.poll(120), "the child did not answer"
    out = a.recv()
    p.join(20)
    return out


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_an_unavailable_nixl_backend_is_a_typed_error_naming_it(role):
    pytest.importorskip("nixl._api")
    pytest.importorskip("vllm.v1.core.kv_cache_planning")
    kind, msg = _build_in_child({"backends": ["NO_SUCH_BACKEND"]}, role)
    assert kind == "TransportUnavailableError" and "NO_SUCH_BACKEND" in msg and "UCX" in msg, (kind, msg)


def test_ucx_with_num_threads_moves_kv_byte_exact():
    """backends ["UCX"] with num_threads 2 on both engines (the transport built from the extra config):
    a TP2 -> TP1 pair reads byte-exact."""
    pytest.importorskip("nixl._api")
    pytest.importorskip("vllm.v1.core.kv_cache_planning")
    from worker_harness import Side, llama, run_pair

    r = run_pair(llama(2), Side(2, 1, 16), Side(1, 1, 16), requests=((60, 0), (33, 1)),
                 extra={"backends": ["UCX"], "num_threads": 2})
    assert r.failed == [] and r.done == ["dec-req-1", "dec-req-2"] and r.sent == ["req-1", "req-2"]
    assert r.checked > 0 and r.bad == 0 and r.untouched_bad == 0


def test_decode_thread_is_read_and_off_the_reads_still_move_on_the_engines_steps():
    """``decode_thread`` (default on: runtime/driver.py) is a checked boolean; with it off the decode worker
    drives its reads from the engine's steps alone, and a TP2 -> TP1 pair still reads byte-exact."""
    assert ConnectorConfig.from_vllm(_cfg(), environ={}).decode_thread is True
    assert ConnectorConfig.from_vllm(_cfg({"decode_thread": False}), environ={}).decode_thread is False
    with pytest.raises(VLLMConfigError, match="decode_thread"):
        ConnectorConfig.from_vllm(_cfg({"decode_thread": "yes"}), environ={})
    pytest.importorskip("nixl._api")
    pytest.importorskip("vllm.v1.core.kv_cache_planning")
    from worker_harness import Side, llama, run_pair

    r = run_pair(llama(2), Side(2, 1, 16), Side(1, 1, 16), requests=((60, 0), (33, 1)),
                 extra={"decode_thread": False})
    assert r.failed == [] and r.done == ["dec-req-1", "dec-req-2"] and r.sent == ["req-1", "req-2"]
    assert r.checked > 0 and r.bad == 0 and r.untouched_bad == 0


def test_gil_switch_us_is_checked_and_only_ever_lowers_the_process_interval():
    """``gil_switch_us`` (default 500): the worker process's GIL switch interval, lowered to it at
    registration (never raised; 0 leaves it), so kvbridge's serving and driver threads get the GIL within
    about that while vLLM's thread runs Python; anything but an integer 0..100000 is a typed error."""
    import sys

    from kvbridge.integrations.vllm.config import DEFAULT_GIL_SWITCH_US
    from kvbridge.integrations.vllm.worker import set_gil_switch

    assert ConnectorConfig.from_vllm(_cfg(), environ={}).gil_switch_us == DEFAULT_GIL_SWITCH_US == 500
    assert ConnectorConfig.from_vllm(_cfg({"gil_switch_us": 0}), environ={}).gil_switch_us == 0
    for bad in ("500", -1, 2.5, True, 100_001):
        with pytest.raises(VLLMConfigError, match="gil_switch_us"):
            ConnectorConfig.from_vllm(_cfg({"gil_switch_us": bad}), environ={})
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        assert set_gil_switch(0) == 0.005  # left as it is
        assert abs(set_gil_switch(500) - 0.0005) < 1e-9  # lowered
        assert abs(set_gil_switch(2000) - 0.0005) < 1e-9  # never raised
    finally:
        sys.setswitchinterval(before)
