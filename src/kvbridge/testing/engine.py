"""Harness: allocate a rank's KV memory as an engine would, and hand it to kvbridge.

``default_memory`` lays the cache out in kvbridge's own layout (:class:`~kvbridge.memory.RankMemory`)
inside one numpy buffer the harness owns; :mod:`kvbridge.testing.engines` builds engine-shaped
tensors (vLLM 0.33, FlashAttention, FlashInfer, separate K/V, MLA, Mamba) instead.
"""
from __future__ import annotations

import numpy as np

from ..layout import EngineLayout
from ..memory import KVMemory, rank_memory


def default_memory(engine: EngineLayout, rank, fill: int = 0, torch=None) -> KVMemory:
    """One buffer in kvbridge's layout for rank ``rank`` of ``engine``, described: a numpy array, or, with
    ``torch`` (the module), a CPU torch tensor over the same bytes (kvbridge then stages with torch ops,
    the code path of CUDA tensors)."""
    buf = np.full(rank_memory(engine, *rank).size, fill, dtype=np.uint8)
    return KVMemory.from_buffer(engine, tuple(rank), buf if torch is None else torch.from_numpy(buf))


def buffer_of(mem: KVMemory) -> np.ndarray:
    """The harness buffer behind a :func:`default_memory` description (numpy, also over a torch tensor)."""
    b = mem.keepalive[0]
    return b if isinstance(b, np.ndarray) else b.numpy()
