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
    with pytest.raises(ConfigError, match="transfer_mode must be auto, direct or staged"):
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
def test_every_option_is_a_constructor_argument_with_the_same_default(cfg, cls):
    params = inspect.signature(cls.__init__).parameters
    for k, v in cfg().kwargs().items():
        assert k in params, k
        assert params[k].default == v, (k, params[k].default, v)
