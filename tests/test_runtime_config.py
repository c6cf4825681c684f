"""Typed rank options (``runtime/config.py``): built from plain mappings, checked once, accepted by the
ranks' constructors."""
from __future__ import annotations

import inspect

import pytest

from kvbridge.runtime.config import ConfigError, DecodeConfig, PrefillConfig
from kvbridge.runtime.decode import DecodeRank
from kvbridge.runtime.prefill import PrefillRank


def test_from_mapping_converts_and_checks():
    d = DecodeConfig.from_mapping({"transfer_timeout_s": "2", "transfer_mode": "staged", "connect_timeout_s": None})
    assert d.transfer_timeout_s == 2.0 and d.transfer_mode == "staged" and d.connect_timeout_s is None
    p = PrefillConfig.from_mapping({"lease_s": 5, "port": "5600", "pin_idle_s": "1.5"})
    assert (p.lease_s, p.port, p.pin_idle_s) == (5.0, 5600, 1.5)
    with pytest.raises(ConfigError, match=r"unknown DecodeConfig option\(s\) \['lease_s'\]"):
        DecodeConfig.from_mapping({"lease_s": 3})
    with pytest.raises(ConfigError, match="transfer_mode must be one of auto, direct, staged, host"):
        DecodeConfig.from_mapping({"transfer_mode": "fast"})
    with pytest.raises(ConfigError, match="stage_timeout_s must be float"):
        DecodeConfig.from_mapping({"stage_timeout_s": "soon"})
    with pytest.raises(ConfigError, match="lease_s must be > 0"):
        PrefillConfig(lease_s=0)
    with pytest.raises(ConfigError, match="staging_peer_share"):
        PrefillConfig(staging_peer_share=1.5)
    with pytest.raises(AttributeError):
        d.transfer_timeout_s = 3  # frozen


@pytest.mark.parametrize("cfg, cls", [(DecodeConfig, DecodeRank), (PrefillConfig, PrefillRank)])
def test_rank_constructors_write_no_option_defaults(cfg, cls):
    """Every option's default is written once, in its config class: a rank's constructor takes the config
    and keyword options replacing its fields, and has no option parameters of its own."""
    params = inspect.signature(cls.__init__).parameters
    assert "config" in params and params["options"].kind is inspect.Parameter.VAR_KEYWORD
    assert not {f for f in cfg().__dataclass_fields__} & set(params)


def test_ranks_are_built_from_their_config():
    from _helpers import layout

    from kvbridge.testing.engine import default_memory
    from kvbridge.transport.loopback import LoopbackRegistry, LoopbackTransport

    reg, lay = LoopbackRegistry(), layout("cfg", 1, 16)
    p = PrefillRank(lay, (0, 0), "pc", memory=default_memory(lay, (0, 0)), transport=LoopbackTransport("pc", reg),
                    config=PrefillConfig(lease_s=7.0, staging_bytes=0), pin_s="9")
    d = DecodeRank(lay, (0, 0), "dc", memory=default_memory(lay, (0, 0)), transport=LoopbackTransport("dc", reg),
                   config=DecodeConfig(transfer_mode="direct", handshake_timeout_s=2.0), rehandshake_timeout_s=0.5)
    try:
        assert (p.config.lease_s, p.config.pin_s, p.config.staging_bytes) == (7.0, 9.0, 0)
        assert (p.lease_s, p.pin_s, p.staging_bytes) == (7.0, 9.0, 0)
        assert d.config == DecodeConfig(transfer_mode="direct", handshake_timeout_s=2.0, rehandshake_timeout_s=0.5)
        assert (d.transfer_mode, d.staging_bytes, d.connect_timeout_s, d.rehandshake_timeout_s) == (
            "direct",
            0,
            9.0,
            0.5,
        )
        with pytest.raises(ConfigError, match=r"unknown DecodeConfig option\(s\) \['lease_s'\]"):
            DecodeRank(lay, (0, 0), "dx", memory=default_memory(lay, (0, 0)), transport=LoopbackTransport("dx", reg),
                       lease_s=3)
        with pytest.raises(ConfigError, match="transfer_mode must be one of auto, direct, staged"):
            d.set_transfer_mode("fast")
    finally:
        d.close()
        p.close()


@pytest.mark.parametrize("v, want", [("true", True), ("False", False), ("1", True), ("off", False), (True, True),
                                     (0, False), ("yes", True)])
def test_optimistic_reads_flag_from_mapping(v, want):
    assert DecodeConfig.from_mapping({"optimistic_reads": v}).optimistic_reads is want


def test_optimistic_reads_passes_through_vllm_extra_config():
    pytest.importorskip("vllm.distributed")  # (the adapter package imports vLLM)
    from kvbridge.integrations.vllm.config import endpoint_configs
    assert endpoint_configs({"optimistic_reads": "false"})[1].optimistic_reads is False
    assert endpoint_configs({"optimistic_reads": True})[1].optimistic_reads is True


def test_optimistic_reads_flag_rejects_other_values():
    with pytest.raises(ConfigError, match="optimistic_reads must be bool, got 'maybe'"):
        DecodeConfig.from_mapping({"optimistic_reads": "maybe"})
    with pytest.raises(ConfigError, match="optimistic_reads must be bool"):
        DecodeConfig.from_mapping({"optimistic_reads": 2})


def test_prefill_server_polls_at_its_endpoints_poll_s():
    """``PrefillConfig.poll_s`` is the one default of the serving thread's poll period: a
    :class:`~kvbridge.PrefillServer` takes it from its endpoint's config unless given one."""
    from _helpers import layout

    from kvbridge.runtime.server import PrefillServer
    from kvbridge.testing.engine import default_memory
    from kvbridge.transport.loopback import LoopbackRegistry, LoopbackTransport

    assert PrefillConfig.from_mapping({"poll_s": "0.01"}).poll_s == 0.01
    with pytest.raises(ConfigError, match="poll_s must be > 0"):
        PrefillConfig(poll_s=0)
    assert inspect.signature(PrefillServer.__init__).parameters["poll_s"].default is None  # no default of its own
    reg, lay = LoopbackRegistry(), layout("cfg", 1, 16)
    for given, want in ((None, 0.05), (0.5, 0.5)):  # (a server closes its endpoint: one rank each)
        p = PrefillRank(lay, (0, 0), f"ps{want}", memory=default_memory(lay, (0, 0)), staging_bytes=0, poll_s=0.05,
                        transport=LoopbackTransport(f"ps{want}", reg))
        s = PrefillServer(p) if given is None else PrefillServer(p, poll_s=given)
        try:
            assert s.poll_s == want
        finally:
            s.close()
    assert PrefillConfig().poll_s == 0.002  # (the default, written once: in PrefillConfig)
