"""Mutation probe of the runtime's sans-IO machines: do the fast tests catch realistic one-line bugs?

Each mutant replaces one exact piece of text (usually one line) in a copy of ``src/`` (the lease machine, the
read machine and its vocabulary, the peer, the staging allocator and the packed-stream helpers, the ``n > 1``
``expect``/``reads`` logic), runs the fast in-process tests against that copy and reports the first test that
failed, or MISSED. Two groups are not sans-IO: the decode read loop's attempt check (``RL*``) and the vLLM
adapter's ``n > 1`` sibling linking (``V*``) run the tests aimed at them first (``FIRST``, pytest node ids), and
are skipped, not counted, where the packages those tests need are not installed (``Mutant.needs``).
Anchors are exact text, so the probe survives unrelated edits of the sources; a mutant whose
anchor is not found (or is ambiguous) is reported as skipped, never silently applied elsewhere. Mutants judged
behaviour-preserving are listed with the reason (``equivalent``) and left out of the catch rate.

    python scripts/mutation_probe.py              # every mutant (2 at a time), then the table and the rate
    python scripts/mutation_probe.py --list       # the mutants, nothing run
    python scripts/mutation_probe.py --only L03 R1 # some of them (ids or id prefixes)

The tests run from a temporary copy of ``tests/`` next to the mutated ``src/`` (``tests/conftest.py`` puts
the ``src/`` beside it first on ``sys.path``), ``pytest -x``: the first failure ends a mutant's run.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RT = "kvbridge/runtime/"
# the fast sans-IO tests, cheapest (example) tests first in each file; property tests come last in their files
FAST_TESTS = [
    "tests/test_readstate.py",
    "tests/test_read_machine.py",
    "tests/test_read_properties.py",
    "tests/test_lease.py",
    "tests/test_lease_bounds.py",
    "tests/test_peer_state.py",
    "tests/test_peer_properties.py",
    "tests/test_slots.py",
    "tests/test_staging_segments.py",
]
# the tests of the mutated file run first (a caught mutant stops at its first failure)
FIRST = {
    RT + "lease.py": ["tests/test_lease_bounds.py", "tests/test_lease.py"],
    RT + "readmachine.py": ["tests/test_read_machine.py", "tests/test_read_properties.py"],
    RT + "readstate.py": ["tests/test_readstate.py", "tests/test_read_machine.py"],
    RT + "peer.py": ["tests/test_peer_state.py", "tests/test_peer_properties.py"],
    RT + "slots.py": ["tests/test_slots.py", "tests/test_staging_segments.py"],
    "kvbridge/staging.py": ["tests/test_staging_segments.py"],
    # not sans-IO: the decode's read loop over a side channel and NIXL agents in this process, and the vLLM
    # adapter's scheduler side next to vLLM's own Scheduler (pytest node ids: only the tests aimed at them)
    RT + "readloop.py": ["tests/test_faults.py::test_the_decode_ignores_answers_naming_another_attempt"],
    "kvbridge/integrations/vllm/scheduler.py": [
        "tests/vllm/test_connector_scheduler.py::test_n_gt_1_siblings_share_a_lease_only_with_the_same_prompt",
        "tests/vllm/test_connector_n2.py",
    ],
}


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str  # under src/
    old: str  # exact text, found exactly once
    new: str
    what: str
    equivalent: str = ""  # why the mutant preserves behaviour (left out of the rate), or ""
    needs: str = ""  # packages its tests need ("a|b": either); none installed: the mutant is skipped, not counted


M = Mutant
L, RM, RS, P = RT + "lease.py", RT + "readmachine.py", RT + "readstate.py", RT + "peer.py"
SL, ST = RT + "slots.py", "kvbridge/staging.py"
RL, VS = RT + "readloop.py", "kvbridge/integrations/vllm/scheduler.py"
NIXL = "nixl_cu12|nixl_cu13|nixl"  # the wheels kvbridge.transport.nixl loads
MUTANTS: list[Mutant] = [
    # ---- the lease machine: attempts, settled ranks, counts ------------------------------------------------
    M(
        "L01",
        L,
        "if lease is not None and lease.attempt == attempt:\n            return lease",
        "if lease is not None:\n            return lease",
        "acquire/heartbeat: attempt check dropped",
    ),
    M(
        "L02",
        L,
        "        if lease.attempt != attempt:\n            return Outcome.STALE, []\n        key: PinKey",
        "        key: PinKey",
        "release: attempt check dropped",
    ),
    M(
        "L03",
        L,
        "        if lease.attempt != attempt:\n            return Outcome.STALE, []\n        if (reader, read_id)",
        "        if (reader, read_id)",
        "decline: attempt check dropped",
    ),
    M(
        "L04",
        L,
        "(reader[1] in claim.settled or lease.claim_settled(ckey))",
        "(lease.claim_settled(ckey))",
        "acquire: a rank that settled may re-pin while its claim is open",
    ),
    M(
        "L05",
        L,
        "        if claim is not None and reader[1] in claim.settled:\n            return LeaseRefused(",
        "        if False:\n            return LeaseRefused(",
        "heartbeat: a settled rank's heartbeat is granted",
    ),
    M(
        "L06",
        L,
        "        if reader[1] in claim.settled:\n            return Outcome.DUPLICATE, []",
        "        if False:\n            return Outcome.DUPLICATE, []",
        "decline: a part settles twice",
    ),
    M(
        "L07",
        L,
        "        if readers != claim.readers:\n            return Outcome.BAD_COUNT, []",
        "        if readers < 1:\n            return Outcome.BAD_COUNT, []",
        "release: readers count not checked",
    ),
    M(
        "L08",
        L,
        "if claim is None and len(lease.claims) >= self.max_reads:",
        "if claim is None and len(lease.claims) > self.max_reads:",
        "max_reads off by one",
    ),
    M(
        "L09",
        L,
        "        if (reader, read_id) in lease.pins:\n            return Outcome.HOLDER, []",
        "        if False:\n            return Outcome.HOLDER, []",
        "decline from the pin's holder accepted",
    ),
    # ---- the lease machine: the three bounds of a pin, deadlines --------------------------------------------
    M(
        "L10",
        L,
        "min(pin.refreshed_at + self.pin_idle_s, stall,",
        "min(pin.refreshed_at + self.pin_s, stall,",
        "idle bound uses pin_s instead of pin_idle_s",
    ),
    M(
        "L11",
        L,
        "stall = pin.progress_at + self.pin_s + pin.inflight / self.min_read_rate",
        "stall = pin.progress_at + self.pin_s",
        "stall bound ignores bytes in flight",
    ),
    M(
        "L12",
        L,
        "return float(pin_s) + max(0, int(nbytes)) / float(min_read_rate)",
        "return float(pin_s)",
        "absolute bound ignores the lease's bytes",
    ),
    M(
        "L13",
        L,
        "pin.deadline = max(pin.deadline, min(",
        "pin.deadline = (min(",
        "a pin's deadline may move earlier (granted time not honoured)",
    ),
    M(
        "L14",
        L,
        "        if done > pin.done:\n",
        "        if done >= pin.done:\n",
        "the same bytes done again counts as progress",
    ),
    M(
        "L15",
        L,
        "            done = min(done, lease.nbytes)\n",
        "            pass\n",
        "progress past the lease's bytes counts",
    ),
    M(
        "L16",
        L,
        "pin.inflight = min(inflight, max(0, lease.nbytes - pin.done))",
        "pin.inflight = inflight",
        "inflight not capped by the bytes not done",
    ),
    M("L17", L, "self.pin_bound_at(lease, pin)))", "float('inf')))", "no absolute bound at all"),
    M(
        "L18",
        L,
        "        stall = pin.progress_at + self.pin_s",
        "        stall = pin.refreshed_at + self.pin_s",
        "stall counted from the last refresh, not the last progress",
    ),
    M(
        "L19",
        L,
        "        lease.deadline = max(lease.deadline, min(now + lease.lease_s, lease.hold_until))\n"
        "        return LeaseGranted(",
        "        lease.deadline = max(lease.deadline, now + lease.lease_s)\n        return LeaseGranted(",
        "queued heartbeats not capped by hold_until",
    ),
    M(
        "L20",
        L,
        "now + max(ls, self.pin_s), nbytes=",
        "now + ls, nbytes=",
        "hold_until is lease_s, not max(lease_s, pin_s)",
    ),
    M(
        "L21",
        L,
        "        lease.deadline = max(lease.deadline, now + lease.lease_s)  # the claim's other ranks",
        "        pass  # the claim's other ranks",
        "a release does not give the claim's other ranks lease_s",
    ),
    M(
        "L22",
        L,
        "        while heap and heap[0][0] <= now:",
        "        while heap and heap[0][0] < now:",
        "tick: a deadline due now is not due",
    ),
    M(
        "L23",
        L,
        "timed_out = [k for k, p in lease.pins.items() if p.deadline <= now]",
        "timed_out = [k for k, p in lease.pins.items() if p.deadline < now]",
        "a pin at its deadline holds",
    ),
    M(
        "L24",
        L,
        "            claim.settled.setdefault(key[0][1], False)\n",
        "            pass\n",
        "a timed-out pin does not settle its rank",
    ),
    M(
        "L25",
        L,
        "        if len(c.settled) >= c.readers:",
        "        if len(c.settled) > c.readers:",
        "claim settled only past its readers",
    ),
    M(
        "L26",
        L,
        "        return not all(c.settled.values()) and not any(",
        "        return not all(c.settled.values()) or any(",
        "a failed claim settles while one of its pins is held",
    ),
    M(
        "L27",
        L,
        "            return min(p.deadline for p in lease.pins.values())\n        return lease.deadline",
        "            return lease.deadline\n        return lease.deadline",
        "heap: pins' deadlines not scheduled",
    ),
    M(
        "L28",
        L,
        "if b.agent != agent and (pins_held(reader) or now - b.last_seen < self.idle_s):",
        "if b.agent != agent and (pins_held(reader) and now - b.last_seen < self.idle_s):",
        "reader table: a pinned idle reader may be rebound",
    ),
    M(
        "L29",
        L,
        "            if progress is not None:\n                self._progress(lease, pin, progress, now)\n",
        "            pass\n",
        "heartbeat progress ignored",
    ),
    # ---- n > 1: expect / reads ----------------------------------------------------------------------------
    M("N01", L, "        if want > lease.reads:\n", "        if want != lease.reads:\n", "expect may lower reads"),
    M(
        "N02",
        L,
        "            lease.deadline = max(lease.deadline, min(now + lease.lease_s, lease.hold_until))\n"
        "        return True",
        "        return True",
        "expect does not give the new sibling lease_s",
    ),
    M("N03", L, "        return min(reads, self.max_reads)", "        return reads", "reads not capped by max_reads"),
    M(
        "N04",
        L,
        "if lease.pins or len(lease.claims) < lease.reads or",
        "if lease.pins or",
        "freed before `reads` claims exist",
    ),
    M(
        "N05",
        L,
        "        if lease is None or lease.attempt != attempt:\n            return False",
        "        if lease is None:\n            return False",
        "expect: attempt check dropped",
    ),
    M("N06", L, "reads=self._reads(reads))", "reads=1)", "register ignores reads"),
    # ---- the read machine ---------------------------------------------------------------------------------
    M(
        "R01",
        RM,
        "        if self.state is not ReadState.ACQUIRING or self.retry_at is not None:\n            return [LetGo()]",
        "        if self.state is not ReadState.ACQUIRING:\n            return [LetGo()]",
        "a grant racing a scheduled retry is used",
    ),
    M(
        "R02",
        RM,
        '        if ev.ttl_s <= 0:\n            return self._fail(ReadEvent.REFUSED, LeaseExpired, "the pin',
        '        if ev.ttl_s < 0:\n            return self._fail(ReadEvent.REFUSED, LeaseExpired, "the pin',
        "a grant with no time left is used",
    ),
    M(
        "R03",
        RM,
        "self.pin_deadline, self.progress_at = self.sent_at + ev.ttl_s, now",
        "self.pin_deadline, self.progress_at = now + ev.ttl_s, now",
        "the pin counted from the answer, not the ask",
    ),
    M(
        "R04",
        RM,
        "self.pin_deadline = max(self.pin_deadline, base + ev.ttl_s)",
        "self.pin_deadline = max(self.pin_deadline, now + ev.ttl_s)",
        "refreshed pin counted from the answer",
    ),
    M(
        "R05",
        RM,
        "        if self.state is not ReadState.ACQUIRING or self.retry_at is not None:\n            return []",
        "        if self.state is not ReadState.ACQUIRING:\n            return []",
        "a refusal racing a scheduled retry is taken",
    ),
    M(
        "R06",
        RM,
        "now - self.first_sent >= self.ctx.register_grace_s",
        "now - self.sent_at >= self.ctx.register_grace_s",
        "register grace counted from the last retry",
    ),
    M(
        "R07",
        RM,
        "        if code in (Code.LEASE_EXPIRED, Code.DONE):",
        "        if code == Code.LEASE_EXPIRED:",
        "'done' refusal not a LeaseExpired",
    ),
    M(
        "R08",
        RM,
        "return [LetGo()] if pins and self.terminal else []",
        "return [LetGo()] if pins else []",
        "a late segment for a read that fell back is let go (a second release)",
    ),
    M(
        "R09",
        RM,
        "pins = isinstance(ev, Segment) or ev.code not in REFUSALS",
        "pins = isinstance(ev, Segment)",
        "a 'no room' stage answer is not a pin",
    ),
    M(
        "R10",
        RM,
        "        self.pin_deadline = self.sent_at + ev.ttl_s\n        if self.staging is None:",
        "        self.pin_deadline = now + ev.ttl_s\n        if self.staging is None:",
        "staged pin counted from the answer",
    ),
    M(
        "R11",
        RM,
        "a >= st.starts.size or st.starts[a] != ev.offset",
        "a >= st.starts.size",
        "segment start not checked against run boundaries",
    ),
    M(
        "R12",
        RM,
        "                or int(st.nbytes[a:b].sum()) != ev.nbytes):",
        "                ):",
        "segment end not checked against run boundaries",
    ),
    M("R13", RM, "            slot=st.slot + ev.offset,", "            slot=st.slot,", "segment's staging slot offset"),
    M("R14", RM, "base + st.slot + ev.offset, host)", "base + st.slot, host)", "segment's local address"),
    M(
        "R15",
        RM,
        'runs=(RunSlice(st.dst, "dst", a, b), st.nbytes[a:b]),',
        'runs=(RunSlice(st.dst, "dst", a, b + 1), st.nbytes[a:b + 1]),',
        "segment scatters one run too many",
    ),
    M(
        "R16",
        RM,
        "[ev.offset, ev.offset + ev.nbytes]",
        "[ev.offset, ev.offset + ev.nbytes - 1]",
        "segment end off by one",
    ),
    M(
        "R17",
        RM,
        "            self.notify_at_end = True  # nothing to read",
        "            pass  # nothing to read",
        "an empty stage never sends its Done",
    ),
    M(
        "R18",
        RM,
        "        if d.total_bytes != ev.total:",
        "        if False:",
        "packed size not checked against our lowering",
    ),
    M(
        "R19",
        RM,
        '        if ev.ttl_s <= 0:\n            return self._fail(ReadEvent.REFUSED, LeaseExpired, "staged',
        '        if ev.ttl_s < 0:\n            return self._fail(ReadEvent.REFUSED, LeaseExpired, "staged',
        "staged with no pin time left is used",
    ),
    M(
        "R20",
        RM,
        "limit = self.ctx.stage_timeout_s if waiting else",
        "limit = self.ctx.transfer_timeout_s if waiting else",
        "waiting states take transfer_timeout_s",
    ),
    M(
        "R21",
        RM,
        "waiting = self.state in AWAITING_REPLY and not (self.state is ReadState.STAGING and not finished)",
        "waiting = self.state in AWAITING_REPLY",
        "staging with segments in flight takes stage_timeout_s",
    ),
    M(
        "R22",
        RM,
        "self.ctx.transfer_timeout_s + self.progress()[1] / self.ctx.min_read_rate",
        "self.ctx.transfer_timeout_s",
        "bytes in flight not allowed at min_read_rate",
    ),
    M(
        "R23",
        RM,
        "        if ev.queued_locally:\n            return now\n",
        "",
        "a local post queue does not stop the clock",
    ),
    M(
        "R24",
        RM,
        "return max(self.progress_at, ev.peer_progress, ev.posted_latest)",
        "return max(self.progress_at, ev.peer_progress)",
        "posting time does not re-arm the deadline",
    ),
    M(
        "R25",
        RM,
        "        if waiting:\n            return self.progress_at\n",
        "",
        "waiting states count peer progress",
    ),
    M(
        "R26",
        RM,
        "        if self.pinned and now >= self.refresh_at:",
        "        if now >= self.refresh_at:",
        "heartbeats for a read not pinned",
    ),
    M(
        "R27",
        RM,
        "        return min(wake, self.refresh_at) if self.pinned else wake",
        "        return wake",
        "wake time ignores the heartbeat",
    ),
    M(
        "R28",
        RM,
        "min(self.ctx.stage_timeout_s, self.ctx.transfer_timeout_s))",
        "max(self.ctx.stage_timeout_s, self.ctx.transfer_timeout_s))",
        "wake time after the earlier deadline",
    ),
    M(
        "R29",
        RM,
        "        t.done, self.progress_at = True, now",
        "        t.done = True",
        "a completed transfer is not progress",
    ),
    M(
        "R30",
        RM,
        "        self.pinned = self.asked = False",
        "        self.pinned = False",
        "released pins leave `asked`",
    ),
    M(
        "R31",
        RM,
        "            if now < self.retry_at:\n",
        "            if now <= self.retry_at:\n",
        "retry one poll late",
    ),
    M(
        "R32",
        RM,
        "            self.retry_at = min(self.retry_at, ev.at)",
        "            self.retry_at = max(self.retry_at, ev.at)",
        "aligned retry goes later",
    ),
    M(
        "R33",
        RM,
        "if self.state is ReadState.STAGE_REQUESTED and ev.ttl_s > 0:  # no room",
        "if self.state is ReadState.STAGE_REQUESTED and ev.ttl_s >= 0:  # no room",
        "fallback with no pin time",
    ),
    M(
        "R34",
        RM,
        "            if ev.expired or ev.code in REFUSALS:",
        "            if ev.code in REFUSALS:",
        "an 'expired' stage error falls back",
    ),
    M(
        "R35",
        RM,
        "self.pinned, self.asked = self.pinned or pins, False",
        "self.pinned, self.asked = pins, False",
        "a later refusal forgets the pin",
    ),
    M(
        "R36",
        RM,
        "            elif not t.cancelled:\n                inflight += t.size",
        "            else:\n                inflight += t.size",
        "cancelled transfers counted in flight",
    ),
    M(
        "R37",
        RM,
        "            if now > self.pin_deadline:  # the read ended after the pin",
        "            if False:  # the read ended after the pin",
        "a read ending after its pin is trusted",
    ),
    M(
        "R38",
        RM,
        "        if now > self.pin_deadline:\n            return out + self._fail(",
        "        if False:\n            return out + self._fail(",
        "a pin running out mid-read is ignored",
    ),
    M(
        "R39",
        RM,
        "        if d.count:\n            t = Transfer(work=d)",
        "        if True:\n            t = Transfer(work=d)",
        "fallback posts an empty read",
    ),
    M(
        "R40",
        RM,
        "        if not self.terminal:\n            self.asked = True",
        "        if True:\n            self.asked = True",
        "a terminal read marked asked",
    ),
    # ---- the read's vocabulary -----------------------------------------------------------------------------
    M(
        "S01",
        RS,
        "    S.POSTED: {E.COMPLETED: S.DONE, **_FAIL},",
        "    S.POSTED: {E.COMPLETED: S.DONE, E.GRANTED: S.POSTED, **_FAIL},",
        "an extra cell: POSTED accepts GRANTED",
    ),
    M(
        "S02",
        RS,
        "AWAITING_REPLY = frozenset({S.ACQUIRING, S.STAGE_REQUESTED, S.STAGING})",
        "AWAITING_REPLY = frozenset({S.ACQUIRING, S.STAGE_REQUESTED})",
        "STAGING between segments not waiting",
    ),
    M(
        "S03",
        RS,
        "        return self.done and (self.runs is None or self.scattered)",
        "        return self.done",
        "a staged transfer finished before its scatter",
    ),
    M(
        "S04",
        RS,
        "E.TIMEOUT: S.FAILED, E.ABORT: S.CANCELLED}",
        "E.TIMEOUT: S.FAILED, E.ABORT: S.FAILED}",
        "abort fails instead of cancelling",
    ),
    M(
        "S05",
        RS,
        "    S.STAGING: {E.STAGE_SEGMENT: S.STAGING, E.STAGE_LAST: S.SCATTERING, **_FAIL},",
        "    S.STAGING: {E.STAGE_SEGMENT: S.STAGING, E.STAGE_LAST: S.SCATTERING, E.STAGE_FULL: S.POSTED, **_FAIL},",
        "an extra cell: STAGING falls back",
    ),
    # ---- the peer ---------------------------------------------------------------------------------------
    M(
        "P01",
        P,
        "    S.LOST: {E.DISCONNECTED: S.LOST, E.RESTARTED: S.LOST, E.CLOSE: S.RETIRED},",
        "    S.LOST: {E.DISCONNECTED: S.LOST, E.RESTARTED: S.LOST, E.CONNECTED: S.LIVE, E.CLOSE: S.RETIRED},",
        "a lost peer may come back",
    ),
    M("P02", P, "            self.closes += 1\n", "", "closes not counted"),
    M(
        "P03",
        P,
        "if p not in self._removed and a not in keep_agents}",
        "if a not in keep_agents}",
        "close removes an agent removed already",
    ),
    M(
        "P04",
        P,
        "for agent in set(remote.agents.values()) - set(keep_agents):",
        "for agent in set(remote.agents.values()):",
        "a late result removes agents another peer uses",
    ),
    M(
        "P05",
        P,
        "        self.future = None\n        if fut.cancelled()",
        "        if fut.cancelled()",
        "a late result released twice",
    ),
    M(
        "P06",
        P,
        "        next_state(self.state, PeerEvent.CONNECTED)  # an illegal event",
        "        pass  # an illegal event",
        "connected() opens the channel before checking the transition",
    ),
    M(
        "P07",
        P,
        "        self.not_before = max(self.not_before, not_before)",
        "        self.not_before = not_before",
        "a second loss reaps earlier",
    ),
    M(
        "P08",
        P,
        '        if now > self.progress.get(prank, float("-inf")):\n',
        "        if True:\n",
        "progress moves back",
    ),
    M("P09", P, "        out, self.outbox = self.outbox, {}", "        out = self.outbox", "outbox not emptied"),
    M(
        "P10",
        P,
        "        out, self.heartbeats = self.heartbeats, {}",
        "        out = dict(self.heartbeats)",
        "heartbeats not emptied",
    ),
    M(
        "P11",
        P,
        "or prank in self.gone or self.state is PeerState.RETIRED:",
        "or prank in self.gone:",
        "a retired peer still names agents",
    ),
    M(
        "P12",
        P,
        "        if self.remote is not None and prank not in self._removed and prank in self.remote.agents:",
        "        if self.remote is not None and prank in self.remote.agents:",
        "remove_agent twice",
    ),
    M("P13", P, "        if why:\n            self.error = why", "        self.error = why", "a later loss erases why"),
    M(
        "P14",
        P,
        "        self.outbox, self.heartbeats, self.unsent, self._pending = {}, {}, [], []",
        "        self.outbox, self.unsent, self._pending = {}, [], []",
        "close keeps queued heartbeats",
    ),
    # ---- staging: the allocator and the packed stream -----------------------------------------------------
    M("SL1", SL, "            if n >= size:", "            if n > size:", "an exact fit refused"),
    M(
        "SL2",
        SL,
        "return max(ALIGN, -(-int(size) // ALIGN) * ALIGN)",
        "return max(ALIGN, int(size) // ALIGN * ALIGN)",
        "extents rounded down (overlap)",
    ),
    M(
        "SL3",
        SL,
        "self._group_bytes.get(group, 0) + size > limit",
        "self._group_bytes.get(group, 0) + size >= limit",
        "a quota cannot be filled",
    ),
    M(
        "SL4",
        SL,
        "            if merged and merged[-1][0] + merged[-1][1] == off:",
        "            if merged and merged[-1][1] == off:",
        "free extents merged wrongly",
    ),
    M(
        "SL5",
        SL,
        "                    self._free[i] = (off + size, n - size)",
        "                    self._free[i] = (off + size, n)",
        "the rest of a split extent grows",
    ),
    M(
        "ST1",
        ST,
        "        np.cumsum(nbytes[:-1], out=out[1:])",
        "        np.cumsum(nbytes[1:], out=out[1:])",
        "packed offsets shifted",
    ),
    M("ST2", ST, "    edges = [0, *cuts, n]", "    edges = [0, *cuts, n - 1]", "last segment one run short"),
    M(
        "ST3",
        ST,
        "    cuts = (np.flatnonzero(np.diff(seg)) + 1).tolist()",
        "    cuts = np.flatnonzero(np.diff(seg)).tolist()",
        "segment cuts one run early",
    ),
    M(
        "ST4",
        ST,
        "    if out_offset + total > _nbytes_of(out):",
        "    if out_offset + total >= _nbytes_of(out):",
        "an exactly full staging buffer refused",
    ),
    M(
        "ST5",
        ST,
        "    copy_runs(buf, dst, staging, offsets(nbytes) + staging_offset, nbytes)",
        "    copy_runs(buf, dst, staging, offsets(nbytes), nbytes)",
        "scatter ignores the staging offset",
    ),
    # ---- added after the tests were written (not aimed at by any test) ------------------------------------
    M(
        "X01",
        L,
        "            if claim is None:\n                lease.claims[ckey] = Claim(readers)",
        "            if False:\n                lease.claims[ckey] = Claim(readers)",
        "acquire makes a pin without its claim",
    ),
    M(
        "X02",
        L,
        "            self._refresh(lease, pin, now)\n            return LeaseGranted(",
        "            return LeaseGranted(",
        "a heartbeat does not refresh its pin",
    ),
    M(
        "X03",
        L,
        "if not pins_held(r) and now - x.last_seen >= self.idle_s",
        "if now - x.last_seen >= self.idle_s",
        "a full reader table evicts a reader holding a pin",
    ),
    M("X04", RM, "        self.sm.fire(ReadEvent.ABORT)\n", "", "an abort leaves the read live"),
    M(
        "X05",
        RM,
        "            self.pinned = False\n            self.sm.fire(ReadEvent.COMPLETED)",
        "            self.sm.fire(ReadEvent.COMPLETED)",
        "nothing to read: the released pin still counts as held",
    ),
    M("X06", P, "        self.gone.add(prank)\n", "", "a dead agent is still named"),
    M(
        "X07",
        ST,
        "    seg = offsets(nbytes) // max(1, int(segment_bytes))",
        "    seg = (offsets(nbytes) + nbytes) // max(1, int(segment_bytes))",
        "segments cut by run ends, not starts",
    ),
    # ---- the decode's read loop: an answer is taken only by the read of its attempt (tests/test_faults.py) --
    M(
        "RL1",
        RL,
        "                or (attempt is not None and attempt != f.req.attempt_for(prank))):",
        "                ):",
        "an answer naming another attempt is taken by the read (attempt check dropped)",
        needs=NIXL,
    ),
    M(
        "RL2",
        RL,
        "f, rr = self._rank_read(peer, prank, msg.req_id, msg.attempt or None, msg.read_id)",
        "f, rr = self._rank_read(peer, prank, msg.req_id, None, msg.read_id)",
        "a packed segment (Staged) looked up without its attempt",
        needs=NIXL,
    ),
    M(
        "RL3",
        RL,
        "        for rid, attempt, read_id, ttl_s in msg.granted:\n"
        "            f, rr = self._rank_read(peer, prank, rid, attempt, read_id)\n            if f is None",
        "        for rid, attempt, read_id, ttl_s in msg.granted:\n"
        "            f, rr = self._rank_read(peer, prank, rid, None, read_id)\n            if f is None",
        "a grant (Acquired) looked up without its attempt",
        needs=NIXL,
    ),
    # ---- the vLLM adapter's n > 1 linking (tests/vllm: needs vLLM) -----------------------------------------
    M("V1", VS, "            sib.reads += 1\n", "", "a linked sibling does not raise the lease's expected reads",
      needs="vllm"),
    M(
        "V2",
        VS,
        "and sib.lease_id in self._held and sib.prompt == key",
        "and sib.lease_id in self._held",
        "siblings with other prompts linked to one lease",
        needs="vllm",
    ),
    M(
        "V3",
        VS,
        "                and int(child.group(1)) not in sib.indices):",
        "                ):",
        "a second finish of the same child index linked again (one read expected too many)",
        needs="vllm",
    ),
    M(
        "V4",
        VS,
        "self._siblings = {k: v for k, v in self._siblings.items() if v.lease_id not in done}",
        "pass",
        "a sibling linked to a lease already freed",
        needs="vllm",
    ),
]


@dataclass
class Result:
    mutant: Mutant
    status: str  # caught, MISSED, skipped, equivalent, timeout
    detail: str = ""
    seconds: float = 0.0


def apply(text: str, m: Mutant) -> str | None:
    """``text`` with ``m`` applied, or None when its anchor is not found exactly once."""
    if text.count(m.old) != 1:
        return None
    return text.replace(m.old, m.new, 1)


_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.M)


def tests_for(m: Mutant | None) -> list[str]:
    first = FIRST.get(m.file, []) if m is not None else []
    present = [t for t in FAST_TESTS if (ROOT / t).exists()]
    first = [t for t in first if (ROOT / t.split("::")[0]).exists()]  # files or pytest node ids
    return first + [t for t in present if t not in first]


def missing(needs: str) -> bool:
    """``needs``: top-level packages, ``|`` between alternatives; True when none is installed (nothing imported)."""
    return bool(needs) and all(importlib.util.find_spec(name) is None for name in needs.split("|"))


def run_one(m: Mutant | None, timeout: float) -> Result | str:
    """Run the fast tests against a copy of ``src`` with ``m`` applied (None: unmutated, returns the output)."""
    with tempfile.TemporaryDirectory(prefix="kvb-mut-") as tmp:
        tmp_p = Path(tmp)
        shutil.copytree(ROOT / "src", tmp_p / "src", ignore=shutil.ignore_patterns("__pycache__"))
        skip = ["__pycache__", "data"] + ([] if m is not None and m.file.startswith("kvbridge/integrations/vllm/")
                                          else ["vllm"])
        shutil.copytree(ROOT / "tests", tmp_p / "tests", ignore=shutil.ignore_patterns(*skip))
        shutil.copy(ROOT / "pyproject.toml", tmp_p / "pyproject.toml")
        if m is not None and missing(m.needs):
            return Result(m, "skipped", f"needs {m.needs} (not installed)")
        if m is not None:
            target = tmp_p / "src" / m.file
            new = apply(target.read_text(), m) if target.exists() else None
            if new is None:
                return Result(m, "skipped", "anchor not found exactly once")
            target.write_text(new)
        env = dict(os.environ, PYTHONPATH=str(tmp_p / "src"), PYTHONDONTWRITEBYTECODE="1")
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "-p", "no:cacheprovider", *tests_for(m)]
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return (
                Result(
                    m,
                    "timeout",
                    f"ran past {timeout:g} s (counted as caught: the suite does not pass)",
                    time.monotonic() - t0,
                )
                if m is not None
                else "timeout"
            )
        out = proc.stdout + proc.stderr
        if m is None:
            return out if proc.returncode else ""
        dt = time.monotonic() - t0
        if proc.returncode == 0:
            return Result(m, "MISSED", "", dt)
        hit = _FAILED.search(out)
        return Result(m, "caught", hit.group(1) if hit else f"pytest exit {proc.returncode}", dt)


def select(only: list[str] | None) -> list[Mutant]:
    if not only:
        return MUTANTS
    return [m for m in MUTANTS if any(m.id == o or m.id.startswith(o) for o in only)]


def report(results: list[Result], elapsed: float) -> tuple[int, int]:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="kvbridge runtime mutation probe")
    for col in ("mutant", "file", "bug", "caught by"):
        table.add_column(col, overflow="fold")
    style = {"caught": "green", "timeout": "green", "MISSED": "bold red", "skipped": "yellow", "equivalent": "dim"}
    for r in results:
        shown = r.detail if r.status == "caught" else f"{r.status}: {r.detail}" if r.detail else r.status
        table.add_row(
            r.mutant.id, r.mutant.file.removeprefix("kvbridge/"), r.mutant.what, f"[{style[r.status]}]{shown}[/]"
        )
    console = Console(width=160)
    console.print(table)
    scored = [r for r in results if r.status in ("caught", "timeout", "MISSED")]
    caught = sum(r.status != "MISSED" for r in scored)
    rate = 100.0 * caught / len(scored) if scored else 0.0
    skipped = [r.mutant.id for r in results if r.status == "skipped"]
    missed = [r.mutant.id for r in results if r.status == "MISSED"]
    console.print(
        f"caught {caught}/{len(scored)} non-equivalent mutants ({rate:.1f} %); "
        f"equivalent {sum(r.status == 'equivalent' for r in results)}; skipped {len(skipped)} {skipped}; "
        f"missed {missed}; {elapsed:.0f} s"
    )
    return caught, len(scored)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--only", nargs="+", metavar="ID", help="run only these mutants (ids or id prefixes)")
    ap.add_argument("--jobs", type=int, default=2, help="mutants run at once (default 2)")
    ap.add_argument("--timeout", type=float, default=90.0, help="seconds per mutant (default 90)")
    args = ap.parse_args(argv)
    chosen = select(args.only)
    if args.list:
        for m in chosen:
            note = f"  [equivalent: {m.equivalent}]" if m.equivalent else ""
            print(f"{m.id:4} {m.file:32} {m.what}{note}")
        return 0
    t0 = time.monotonic()
    failed = run_one(None, args.timeout * 2)
    if failed:
        print("the unmutated sources fail the fast tests; fix that first:\n", failed[-4000:], file=sys.stderr)
        return 2
    todo = [m for m in chosen if not m.equivalent]
    results = {m.id: Result(m, "equivalent", m.equivalent) for m in chosen if m.equivalent}
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        for r in pool.map(lambda m: run_one(m, args.timeout), todo):
            assert isinstance(r, Result)
            results[r.mutant.id] = r
            print(f"{r.mutant.id}: {r.status} {r.detail} ({r.seconds:.0f} s)", flush=True)
    caught, scored = report([results[m.id] for m in chosen], time.monotonic() - t0)
    return 0 if scored and caught == scored else 1


if __name__ == "__main__":
    sys.exit(main())
