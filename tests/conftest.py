"""Shared test setup (kept minimal): make ``src/`` importable even without ``PYTHONPATH=src``; the ``pair``
fixture of the reliability tests (its helpers live in ``_helpers.py``, imported when it is asked for).

Spawned rank processes (``multiprocessing`` spawn context) inherit ``sys.path`` from the test process.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

_SRC = str(Path(__file__).resolve().parents[1] / "src")
if _SRC not in sys.path:
    sys.path.insert(0, _SRC)


@pytest.fixture(scope="module")
def pair():
    """A prefill/decode pair of NIXL rank processes (prefill tp=2 -> decode tp=1, engines "pm" -> "dm",
    handshaken), one per test module that asks for it (``tests/_helpers.py``: :class:`Pair`)."""
    from _helpers import Cluster, Jobs, Pair, layout

    pl, dl = layout("prefill", 2, 2048), layout("decode", 1, 2048)
    with Cluster() as c:
        P, D = c.start_many([("prefill", pl, "pm"), ("decode", dl, "dm")])
        D.call_all("handshake", "pm", P.endpoints())
        jobs = Jobs(dl, seed=7)
        jobs.engine("pm", pl)
        yield Pair(P, D, pl, dl, jobs, [])
