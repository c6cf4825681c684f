"""Context parallelism across processes (issue 21): one process per rank on each side, real NIXL (UCX),
every decode byte checked against the oracle (whose token -> rank map is vLLM's, written apart from
the planner), prefill frees every request, no handle leaked."""
import pytest

from kvbridge.layout import CacheGroup, EngineLayout, MemoryLayout, ModelSpec
from kvbridge.models import preset
from kvbridge.plan import plan_transfer
from kvbridge.transport.nixl import nixl_available

pytestmark = [pytest.mark.nixl, pytest.mark.skipif(not nixl_available(), reason="nixl not installed")]

GQA1 = ModelSpec("gqa1", 4, (CacheGroup("full", "full_attention", (0, 1, 2, 3), "bfloat16", num_heads=1, head_dim=64),))


def eng(model, role, layout="flash_attn_hnd", **kw):
    return EngineLayout(model, memory=MemoryLayout.parse(layout), role=role, **kw)


CASES = {
    # DeepSeek-style MLA: prefill TP4 (latent replicated) -> decode TP4 x DCP4, vLLM NIXL's interleave = block size
    "mla P tp4 -> D tp4 dcp4": (eng(preset("tiny-mla"), "prefill", tp=4, block_size=16),
                                eng(preset("tiny-mla"), "decode", tp=4, dcp=4, cp_interleave=16, block_size=16,
                                    layout="flash_attn")),
    # GQA: prefill PCP2 (each PCP rank holds the whole cache) -> decode TP2 x DCP2, different block sizes
    # and interleave (vLLM's attention backends run PCP for MLA only; the geometry is the same)
    "gqa P pcp2 bs32 -> D tp2 dcp2 bs16 il8": (eng(GQA1, "prefill", tp=1, pcp=2, block_size=32),
                                                eng(GQA1, "decode", tp=2, dcp=2, cp_interleave=8, block_size=16,
                                                    layout="LBHNC")),
    # DCP on both sides, sizes that do not divide each other
    "mla P tp2 dcp2 -> D tp3 dcp3": (eng(preset("tiny-mla"), "prefill", tp=2, dcp=2, cp_interleave=4, block_size=8),
                                     eng(preset("tiny-mla"), "decode", tp=3, dcp=3, cp_interleave=2, block_size=4)),
    # DCP prefill -> plain decode: prefill ranks 2 and 3 (replicas of DCP ranks 0 and 1) are read by nobody and
    # must still free every request (a designated decode rank notifies them)
    "mla P tp4 dcp2 -> D tp1, replicas unread": (eng(preset("tiny-mla"), "prefill", tp=4, dcp=2, cp_interleave=8,
                                                     block_size=8),
                                                 eng(preset("tiny-mla"), "decode", tp=1, block_size=16)),
}


@pytest.mark.parametrize("mode", ["direct", "staged"])
@pytest.mark.parametrize("name", list(CASES))
def test_cp_cross_process_transfer_is_exact(name, mode):
    from kvbridge.testing.demo import run_demo
    prefill, decode = CASES[name]
    res = run_demo(prefill, decode, num_requests=6, max_tokens=300, seed=hash(name) % 1000, show_progress=False,
                   transfer_mode=mode)
    assert not res.failed and not res.start_errors, (res.failed, res.start_errors)
    assert res.finished == res.requests == 6
    assert res.bytes_needed > 0 and res.mismatched_bytes == 0
    assert res.bytes_moved == res.bytes_needed  # read amplification exactly 1.0
    assert (res.staged_transfers > 0) == (mode == "staged") and (res.direct_transfers > 0) == (mode == "direct")
    assert res.prefill_freed == res.requests and res.leaked_handles == 0
    assert res.ok


def test_unread_cp_replicas_have_a_notifier():
    plan = plan_transfer(*CASES["mla P tp4 dcp2 -> D tp1, replicas unread"])
    assert plan.readers_of((0, 2)) == plan.readers_of((0, 3)) == ()
    assert plan.notifiers_of((0, 2)) == plan.notifiers_of((0, 3)) == ((0, 0),)
