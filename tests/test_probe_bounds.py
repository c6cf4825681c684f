"""The link probe's bounds and figures on a modelled link with a fake clock (no real time is asserted).

Every transfer the probe times is answered by a model (``fixed + descs * per_desc + bytes / bandwidth``)
that advances a fake ``perf_counter``; a transfer whose modelled time exceeds its timeout advances the
clock by the timeout and is given up, as a real one is. So the tests check, exactly and without timing
anything: the figures a fast link yields are the model's; the measuring of a prefill rank ends within
``probe_ms`` of (fake) time and moves at most ``probe_bytes``; a link too slow for its share is reported
as a bound (at most that fast, never faster than it is); connecting is outside the budget.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pytest

from kvbridge.modes import TransferPath
from kvbridge.runtime import probe


@dataclass
class Clock:
    now: float = 1000.0

    def perf_counter(self) -> float:
        return self.now


@dataclass
class Link:
    """A modelled link: seconds of one transfer of ``descs`` descriptors and ``nbytes`` bytes."""

    clock: Clock
    fixed_s: float
    per_desc_s: float
    gbps: float
    timeouts: list[float] = field(default_factory=list)
    moved: int = 0
    calls: int = 0

    def cost(self, descs: int, nbytes: int) -> float:
        return self.fixed_s + descs * self.per_desc_s + nbytes / (self.gbps * 1e9)

    def transfer(self, offsets: np.ndarray, nbytes: np.ndarray, timeout: float) -> float | None:
        self.calls += 1
        self.timeouts.append(timeout)
        c = self.cost(len(offsets), int(np.asarray(nbytes).sum()))
        if c > timeout:
            self.clock.now += timeout
            return None
        self.clock.now += c
        self.moved += int(np.asarray(nbytes).sum())
        return c


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()

    class _Time:
        perf_counter = staticmethod(c.perf_counter)

        @staticmethod
        def sleep(_s: float) -> None:
            pass

    monkeypatch.setattr(probe, "time", _Time)
    return c


TARGET = probe.Target(0x10000, 64 << 20, "cpu", 0x20000000, 16 << 20, None)


def test_a_fast_link_yields_the_models_figures_within_its_share(clock):
    link = Link(clock, fixed_s=20e-6, per_desc_s=1e-6, gbps=8.0)
    t0 = clock.now
    end = t0 + 0.05
    got = probe.measure_kind(None, "peer", TARGET, end, 64 << 20, timer=link.transfer)
    assert got is not None and not got.bound
    assert got.per_desc_us == pytest.approx(1.0, rel=1e-6)
    assert got.gbps == pytest.approx(8.0, rel=1e-6)
    assert clock.now <= end and got.seconds == pytest.approx(clock.now - t0)
    assert got.nbytes == link.moved <= 64 << 20
    assert all(t <= end - t0 + 1e-12 for t in link.timeouts)  # no transfer may outlive the share


def test_a_byte_budget_caps_the_largest_transfer(clock):
    link = Link(clock, fixed_s=20e-6, per_desc_s=1e-6, gbps=8.0)
    got = probe.measure_kind(None, "peer", TARGET, clock.now + 10.0, 2 << 20, timer=link.transfer)
    assert got is not None and got.nbytes == link.moved <= 2 << 20
    assert got.gbps == pytest.approx(8.0, rel=1e-6)


@pytest.mark.parametrize("gbps,fixed_s", [(2e-3, 2e-3), (2e-4, 2e-3), (1e-6, 1e-3)])
def test_a_link_too_slow_for_its_share_is_a_bound_never_faster_than_it_is(clock, gbps, fixed_s):
    """2 ms + 500 ms per MiB (KVBRIDGE_DELAY_LINK's test setting) and slower: a transfer is given up at
    the end of the share; the kind is reported at most that fast, and the bound is above the truth."""
    link = Link(clock, fixed_s=fixed_s, per_desc_s=0.0, gbps=gbps)
    t0 = clock.now
    end = t0 + 0.0167  # a third of the default 50 ms
    got = probe.measure_kind(None, "peer", TARGET, end, 64 << 20, timer=link.transfer)
    assert clock.now == pytest.approx(end) or clock.now < end
    assert got is not None and got.bound
    assert got.gbps >= gbps * (1 - 1e-9)                # an upper bound: never slower than reported
    assert got.gbps < 100 * gbps or got.gbps < 0.01     # and says the link is slow
    assert all(t <= end - t0 + 1e-12 for t in link.timeouts)


def test_a_failed_transfer_is_not_a_bound(clock):
    """A transfer that fails (an error, not a timeout) says nothing of the link's speed."""
    link = Link(clock, fixed_s=20e-6, per_desc_s=1e-6, gbps=8.0)

    def failing(offsets, nbytes, timeout):
        return None if len(offsets) > 1 else link.transfer(offsets, nbytes, timeout)
    assert probe.measure_kind(None, "peer", TARGET, clock.now + 0.05, 64 << 20, timer=failing) is None


class _KV:
    device = "cpu"
    usable = True

    def new_staging(self, nbytes: int) -> np.ndarray:
        return np.zeros(nbytes, np.uint8)


class _Transport:
    def register(self, buf: np.ndarray) -> int:
        return int(buf.ctypes.data)


class _Push:
    """The push probe of a prefill rank: an empty probe answers; WRITEs are timed by the model."""

    def __init__(self, link: Link):
        self.link, self.asked = link, 0

    def ask(self, addr, device, descs, nbytes, stride, timeout_s):
        self.asked += 1
        return 1e-4

    def timer(self, target):
        return self.link.transfer


@pytest.mark.parametrize("slow", [None, "device", "host", "push"])
def test_a_prefill_ranks_probe_ends_within_probe_ms_and_probe_bytes(clock, monkeypatch, slow):
    """Three kinds (device READ, host READ, push WRITE): connecting first (outside the budget), then the
    measuring within ``probe_ms`` of (fake) time and ``probe_bytes``; each kind its share of the time
    left; the fast kinds measured exactly, a slow one slow (exactly, or as a bound)."""
    from kvbridge.cost import CostModel
    links = {k: Link(clock, fixed_s=20e-6, per_desc_s=1e-6, gbps=(2e-3 if k == slow else 8.0))
             for k in ("device", "host", "push")}
    connect_s = 0.03  # a slow first connection: outside the budget

    def timed(transport, agent, t, offsets, nbytes, timeout_s):
        return links["host" if t.local_device == "cpu" else "device"].transfer(offsets, nbytes, timeout_s)

    def warm_up(transport, agent, t, timer=None, end=None):
        clock.now += connect_s
        return True
    monkeypatch.setattr(probe, "_timed", timed)
    monkeypatch.setattr(probe, "_warm_up", warm_up)
    monkeypatch.setattr(probe.Prober, "copy_rates", lambda self: (10.0, 10.0, 1.0))
    p = probe.Prober(_Transport(), _KV(), CostModel(), probe_ms=50.0, probe_bytes=64 << 20)
    p.prepare()
    paths = [TransferPath.DIRECT, TransferPath.STAGED, TransferPath.HOST, TransferPath.PUSH]
    t0 = clock.now
    push = _Push(links["push"])
    fig = p.link("peer", (0x10000, 64 << 20, "cpu"), (0x90000000, 64 << 20), paths, push=push,
                 push_bytes=64 << 20)
    assert push.asked >= 1 and fig.source == "probe"
    assert fig.probe_connect_ms == pytest.approx(3 * connect_s * 1e3)
    assert fig.probe_wall_ms <= 50.0 + 1e-6
    assert clock.now - t0 <= 3 * connect_s + 0.05 + 1e-9
    assert fig.probe_bytes == sum(k.moved for k in links.values()) + 3 * probe.SMALL_BYTES <= 64 << 20
    for path, kind in ((TransferPath.DIRECT, "device"), (TransferPath.HOST, "host"), (TransferPath.PUSH, "push")):
        f = fig.paths[path]
        assert f.measured
        if kind == slow:  # measured, or a bound when its share was too short: slow either way, never faster
            assert f.gbps >= 2e-3 * (1 - 1e-9) and (f.bound or f.gbps == pytest.approx(2e-3, rel=1e-6))
            assert f.gbps < 0.01
        else:
            assert not f.bound and f.gbps == pytest.approx(8.0, rel=1e-6)
            assert f.per_desc_us == pytest.approx(1.0, rel=1e-6)
    assert fig.paths[TransferPath.STAGED].gbps == fig.paths[TransferPath.DIRECT].gbps
    assert math.isfinite(fig.probe_ms)


def test_connecting_to_a_frozen_prefill_costs_one_warm_up_not_one_per_kind(clock, monkeypatch):
    """A prefill that answers no warm-up in time (starved, frozen): connecting ends within ``WARMUP_S``
    for all kinds together, the kinds not reached are not tried, and nothing is measured (the link keeps
    the machine-wide figures)."""
    from kvbridge.cost import CostModel
    tried: list[str] = []

    def warm_up(transport, agent, t, timer=None, end=None):
        tried.append(t.local_device)
        clock.now = end  # it did not end: given up at the end of the connecting time
        return False
    monkeypatch.setattr(probe, "_warm_up", warm_up)
    monkeypatch.setattr(probe.Prober, "copy_rates", lambda self: (10.0, 10.0, 1.0))
    p = probe.Prober(_Transport(), _KV(), CostModel(), probe_ms=50.0, probe_bytes=64 << 20)
    p.prepare()
    paths = [TransferPath.DIRECT, TransferPath.STAGED, TransferPath.HOST, TransferPath.PUSH]
    push = _Push(Link(clock, fixed_s=20e-6, per_desc_s=1e-6, gbps=8.0))
    t0 = clock.now
    fig = p.link("peer", (0x10000, 64 << 20, "cpu"), (0x90000000, 64 << 20), paths, push=push,
                 push_bytes=64 << 20)
    assert len(tried) == 1 and push.asked == 0
    assert clock.now - t0 == pytest.approx(probe.WARMUP_S)
    assert fig.probe_connect_ms == pytest.approx(probe.WARMUP_S * 1e3)
    assert fig.source != "probe" and not any(f.measured for f in fig.paths.values())


@dataclass
class NoisySmallLink(Link):
    """A link whose one-descriptor transfers each take ``small_extra_s`` more (a clock that includes the
    measuring side's scheduling: the push probe's WRITE timed by a busy prefill's thread)."""

    small_extra_s: float = 0.0

    def cost(self, descs: int, nbytes: int) -> float:
        extra = self.small_extra_s if descs == 1 and nbytes <= probe.SMALL_BYTES else 0.0
        return super().cost(descs, nbytes) + extra


@pytest.mark.parametrize("extra_s", [5e-3, 20e-3])
def test_a_noisy_fixed_cost_never_makes_a_link_look_faster_or_its_descriptors_cheaper(clock, extra_s):
    """When the one-descriptor transfer takes 95 % of the largest one's time or more, its time is noise, not the
    fixed cost: the figures come without it, so the link is reported no faster than it is and a descriptor
    no cheaper (taking the noise out made a push probe read 107 GB/s and 0.01 us per descriptor)."""
    link = NoisySmallLink(clock, fixed_s=20e-6, per_desc_s=1e-6, gbps=8.0, small_extra_s=extra_s)
    got = probe.measure_kind(None, "peer", TARGET, clock.now + 0.05, 64 << 20, timer=link.transfer)
    assert got is not None
    assert got.gbps <= 8.0 * (1 + 1e-9) and got.gbps > 1.0
    assert got.per_desc_us >= 1.0 * (1 - 1e-9)
