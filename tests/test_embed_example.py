"""The README's embedding example runs: two processes, each allocating its own tensors, KV over NIXL."""
import subprocess
import sys
from pathlib import Path

import pytest

from kvbridge.transport.nixl import nixl_available

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "embed_two_process.py"


@pytest.mark.nixl
@pytest.mark.skipif(not nixl_available(), reason="needs nixl")
def test_embedding_example_reads_the_prefills_kv():
    r = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 wrong elements" in r.stdout and "prefill: freed" in r.stdout
