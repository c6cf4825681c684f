"""Helpers for engine integrations, and the integrations themselves (:mod:`kvbridge.integrations.vllm`).

* :func:`from_hf_config` -- a Hugging Face ``config.json`` as a :class:`~kvbridge.ModelSpec`
  (:class:`ConfigImportError` names what it cannot read);
* :class:`CacheGroup`, :class:`MambaSpec`, :func:`dtype_size` -- to describe an engine's KV-cache groups
  when its own config says more than the model's (an engine's cache planner, a draft model);
* :func:`nixl_transport` -- an endpoint's NIXL transport with chosen backends and threads;
* :class:`DecodeDriver` -- a decode endpoint's reads driven by a background thread as their events happen,
  for an engine that polls only on its steps (the decode side's :class:`~kvbridge.PrefillServer`).

Importing this module pulls in neither ZMQ, NIXL, torch nor an engine.
"""
from __future__ import annotations

from ..errors import ConfigImportError
from ..layout import CacheGroup, MambaSpec, dtype_size

# a CacheGroup's kind, for annotations (a typing.Literal: it has no docstring of its own, so it is not in __all__)
from ..layout import GroupKind as GroupKind
from ..models import from_hf_config
from ..runtime.driver import DecodeDriver
from ..runtime.server import nixl_transport

__all__ = ["from_hf_config", "ConfigImportError", "CacheGroup", "MambaSpec", "dtype_size", "nixl_transport",
           "DecodeDriver"]
