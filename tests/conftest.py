"""Shared test setup (kept minimal): make ``src/`` importable even without ``PYTHONPATH=src``.

Spawned rank processes (``multiprocessing`` spawn context) inherit ``sys.path`` from the test process.
"""
from __future__ import annotations

import sys
from pathlib import Path

_SRC = str(Path(__file__).resolve().parents[1] / "src")
if _SRC not in sys.path:
    sys.path.insert(0, _SRC)
