"""Runtime over the in-process LoopbackTransport: handshake, direct (prepared lists) and staged reads,
notifications, leases and releases, without NIXL processes or agents."""
from __future__ import annotations

import itertools

import pytest
from _helpers import Jobs, hold, layout, served, until

from kvbridge.runtime.decode import DecodeRank
from kvbridge.runtime.prefill import PrefillRank
from kvbridge.testing.engine import buffer_of, default_memory
from kvbridge.testing.oracle import SENTINEL
from kvbridge.testing.procs import verify_rank
from kvbridge.transport.loopback import LoopbackRegistry, LoopbackTransport

_n = itertools.count()


@pytest.mark.parametrize("mode", ["direct", "staged", "host", "push"])
def test_loopback_ranks_read_release_and_notify(mode):
    pres, dec = _loopback_read(mode)
    m = dec.metrics
    if mode == "push":  # the prefill WROTE every segment into the decode's staging: no READ was posted
        assert m.pushed_transfers == m.staged_transfers == m.transfers > 0 and m.host_staged_transfers == 0
        assert sum(p.metrics.pushed_segments for p in pres) == m.transfers
        assert not dec.reads.push_holds and dec.slots.bytes_used == 0
        for p in pres:  # the decode's agent was added for the WRITEs and removed with the prefill's transport
            assert p.transport.stats.peers_added == p.transport.stats.peers_removed == 1
            assert p.stats()["pushing"] == 0 and p.slots.bytes_used == 0
    elif mode == "host":
        assert m.host_staged_transfers == m.staged_transfers > 0 and m.pushed_transfers == 0


@pytest.mark.parametrize("mode,over", [("staged", "loopback"), ("direct", "loopback"), ("staged", "nixl"),
                                       ("push", "loopback"), ("push", "nixl")])
def test_staged_read_over_torch_tensor_memory(mode, over, monkeypatch):
    """KV memory given as (CPU) torch tensors: both ranks' staging buffers are torch tensors on the
    memory's device (registered from the tensor) and pack/scatter run as torch index/copy operations
    there: the code path of CUDA tensors (where the buffers are VRAM), byte-exact here; over the
    loopback transport and over NIXL agents (in-process)."""
    torch = pytest.importorskip("torch")
    if over == "nixl":
        from kvbridge.transport.nixl import NixlTransport, nixl_available
        if not nixl_available():
            pytest.skip("NIXL not installed")
        # (a pushing prefill's agent is used by its serving thread and its post thread: thread-safe mode)
        monkeypatch.setattr("test_loopback_runtime.LoopbackTransport",
                            lambda name, reg: NixlTransport(name, multi_threaded=mode == "push"
                                                            or not name.startswith("pl")))
    from kvbridge import staging
    calls = []
    real = staging._copy_runs_torch  # a spy: which copy path ran (no public count of torch copies)
    monkeypatch.setattr(staging, "_copy_runs_torch", lambda *a: (calls.append(a[1].device.type), real(*a))[1])
    pres, dec = _loopback_read(mode, torch=torch)
    assert dec.transport.name == over
    for r in (*pres, dec):
        assert isinstance(r.staging, torch.Tensor) and r.staging.device == torch.device("cpu")
        assert r.staging_bytes == r.staging.numel() > 0 or (r is dec and mode == "direct")  # direct: none
    if mode in ("staged", "push"):
        assert dec.metrics.staged_transfers > 0
        assert dec.metrics.pushed_transfers == (dec.metrics.staged_transfers if mode == "push" else 0)
        assert calls and set(calls) == {"cpu"}  # every pack and scatter went through torch
    else:
        assert not calls


def test_loopback_direct_reads_post_spans(monkeypatch):
    """MLA (runs are whole blocks on both sides) with free lists in order: the runtime's direct reads
    post spans through the second list pair (levels set small for these small requests), byte-exact."""
    from kvbridge import prepped
    from kvbridge.models import load_model
    from kvbridge.testing.verify import BlockPool
    monkeypatch.setattr(prepped, "SPAN_LEVELS", (4,))
    monkeypatch.setattr(prepped, "SPAN_MIN_SAVED_PER_STRETCH", 0)
    monkeypatch.setattr(prepped, "SPAN_MIN_IDS", 0)
    used = []
    real = prepped.PreparedGeometry.request
    monkeypatch.setattr(prepped.PreparedGeometry, "request",
                        lambda self, *a: (lambda r: (used.append(r.spans), r)[1])(real(self, *a)))
    _loopback_read("direct", model=load_model("tiny-mla"),
                   pools=lambda lay, rng: BlockPool(lay, rng, shuffled=False))
    assert used and any(used)


def _loopback_read(mode, torch=None, model=None, pools=None):
    reg = LoopbackRegistry()
    k = next(_n)
    kw = {} if model is None else {"model": model}
    pl, dl = layout("prefill", 2, 128, **kw), layout("decode", 1, 128, **kw)
    jobs = Jobs(dl, seed=7)
    jobs.engine("pl", pl)
    if pools is not None:  # block allocators other than shuffled free lists
        jobs.dpool = pools(dl, jobs.rng)
        jobs.ppools["pl"] = (pl, pools(pl, jobs.rng))
    pres = [PrefillRank(pl, (0, r), memory=default_memory(pl, (0, r), torch=torch), engine_id="pl",
                        transport=LoopbackTransport(f"pl{k}-{r}", reg)) for r in range(2)]
    dec = None
    try:
        with served(pres[0]) as lock0, served(pres[1]) as lock1:
            dec = DecodeRank(dl, (0, 0), memory=default_memory(dl, (0, 0), torch=torch), engine_id="dl",
                             transfer_mode=mode,
                             transport=LoopbackTransport(f"dl{k}", reg))
            buffer_of(dec.mem).fill(SENTINEL)
            dec.handshake("pl", {(0, r): f"127.0.0.1:{p.port}" for r, p in enumerate(pres)})
            peer = dec.remotes["pl"]  # prepared lists for every prefill rank this rank reads from
            assert peer.prepped and set(peer.prepped) == {p for p, t in peer.lowered.by_prefill.items() if t}
            js = jobs.make("pl", 6)
            for j in js:
                e = min(hold(p, lock, j) for p, lock in ((pres[0], lock0), (pres[1], lock1)))
                dec.start(j.read(e))
            done, failed = dec.wait(20)
            assert set(done) == {j.rid for j in js} and not failed, failed
            assert verify_rank(dec, [(j.num, j.read()) for j in js])["mismatched_bytes"] == 0
            freed = {0: set(), 1: set()}

            def all_freed():
                for r, (p, lock) in enumerate(((pres[0], lock0), (pres[1], lock1))):
                    with lock:
                        freed[r].update(p.take_freed()["freed"])
                return all(f >= {j.rid for j in js} for f in freed.values())

            until(all_freed, 10, "in-process prefill ranks to free")
            assert dec.stats()["live_handles"] == 0
    finally:
        if dec is not None:
            dec.close()
        for p in pres:
            p.close()
    s = dec.transport.stats
    assert s.handles_created == s.handles_released and s.peers_added == s.peers_removed
    assert s.dlists_prepared == s.dlists_released
    assert s.regions_registered == s.regions_deregistered
    return pres, dec
