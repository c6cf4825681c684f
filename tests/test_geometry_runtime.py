"""Bug classes the runtime suite did not catch (issue 20, point 9), over real rank processes and NIXL:

* prepared descriptor lists when the two engines have different ``num_blocks`` (a list sized or indexed
  by the wrong side's block count reads the wrong bytes or runs off the region);
* a request tail (after a prefix-cache hit) that starts inside a prefill block, with different block
  sizes (token strides) and different TP on the two sides.

Every case reads many requests with random prefix hits, directly (through the prepared lists) and
staged, and compares every byte of the decode buffer with the oracle."""
from __future__ import annotations

import numpy as np
import pytest
from _helpers import MODEL, Cluster, Jobs, collect, needed_bytes, publish, start, verify, wait_freed

from kvbridge.layout import EngineLayout
from kvbridge.transport.nixl import nixl_available

pytestmark = [pytest.mark.nixl, pytest.mark.skipif(not nixl_available(), reason="nixl is not installed")]


@pytest.mark.parametrize("mode", ["direct", "staged"])
@pytest.mark.parametrize("p_tp, p_bs, p_blocks, d_tp, d_bs, d_blocks", [
    (2, 4, 700, 1, 8, 333),    # decode blocks twice as large, far fewer of them
    (1, 8, 260, 2, 4, 1100),   # prefill blocks larger, decode has many more
    (2, 16, 150, 2, 4, 900),   # same TP, 4x token stride
])
def test_different_num_blocks_and_token_strides_read_exactly(mode, p_tp, p_bs, p_blocks, d_tp, d_bs, d_blocks):
    pl = EngineLayout(MODEL, tp=p_tp, block_size=p_bs, num_blocks=p_blocks, role="prefill")
    dl = EngineLayout(MODEL, tp=d_tp, block_size=d_bs, num_blocks=d_blocks, role="decode")
    rng = np.random.default_rng(71)
    n = 24
    lengths = rng.integers(5, 90, size=n)
    jobs = Jobs(dl, seed=72)
    jobs.engine("pG", pl)
    with Cluster() as c:
        P, D = c.start_many([("prefill", pl, "pG"), ("decode", dl, "dG", {"transfer_mode": mode})])
        D.call_all("handshake", "pG", P.endpoints())
        js = jobs.make("pG", n, lengths=lengths, prefix_p=0.7)  # most requests start after a prefix hit
        mid = [j for j in js if any(b.first_block * d_bs % p_bs for b in j.req.decode_blocks.values())]
        publish(P, js)
        start(D, [j.read() for j in js])
        finished, failed = collect(D, 60)
        assert not failed and finished == {j.rid for j in js}, failed
        ver = verify(D, js)
        print(f"P tp{p_tp} bs{p_bs} x{p_blocks} -> D tp{d_tp} bs{d_bs} x{d_blocks} ({mode}): {n} requests, "
              f"{len(mid)} tails start inside a prefill block; {ver['needed_bytes']} B, "
              f"{ver['mismatched_bytes']} wrong")
        assert ver["mismatched_bytes"] == 0 and ver["needed_bytes"] == needed_bytes(pl, dl, js)
        if p_bs > d_bs:
            assert mid, "no tail started inside a prefill block: change the seed"
        wait_freed(P, {j.rid for j in js})
