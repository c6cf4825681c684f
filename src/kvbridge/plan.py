"""Geometry: which prefill rank supplies which part of every decode rank's cache.

Every rank holds a *box* of each group's global index space: a layer range (its PP stage) times,
for each component, a unit range (its TP shard, or one replicated unit). A plan covers each decode
rank's box with pieces of prefill boxes:

* each element of a decode box is read exactly once, from a prefill rank that holds it;
* per decode rank and prefill stage, the set of prefill ranks is as small as possible: along the TP
  axis every needed piece of every component is an interval of prefill ranks that hold it (one rank,
  or the replicas of a replicated unit), so choosing ranks is interval stabbing, which the greedy
  "stab at the earliest right end" solves exactly;
* within that freedom the choice prefers the decode rank's *natural* partner ``d * Tp // Td``, so
  decode ranks that need the same replicated unit spread over its replicas.

Worked example: Gemma-4 style, sliding group with 16 KV heads and full group with 4, prefill tp=8,
decode tp=2. Prefill rank p holds sliding heads [2p, 2p+2) and full head p//2 (2 replicas each).
Decode rank 0 holds sliding heads [0, 8) and full heads [0, 2). Needed pieces as prefill-rank
intervals: sliding [0,0],[1,1],[2,2],[3,3]; full [0,1] (head 0), [2,3] (head 1). Stabbing picks
ranks 0, 1, 2, 3: four reads (0: sliding 0:2 + full 0:1, 1: sliding 2:4, 2: sliding 4:6 + full
1:2, 3: sliding 6:8). Decode rank 1 reads ranks 4..7 the same way. No element is read twice.

Context parallelism adds a token axis to the box (:class:`~kvbridge.layout.CyclicShare`). A prefill
with ``dcp > 1`` splits each token-sharded group into *classes*, one per prefill DCP rank ``k`` (the
tokens that DCP rank stores); the ranks of class ``k`` hold distinct TP ranks, so the holders of a unit
piece are again an interval of them and the stabbing above runs per class (exact: classes have
disjoint holders). A class whose tokens miss the decode rank's own share is skipped. PCP without DCP
replicates the cache: the decode rank reads one PCP copy (its natural partner's), so decode ranks
spread over the copies. A read carries the token shares it is restricted to (``Read.tokens``: the
decode rank's and the prefill class's). Mamba state (never token-sharded) next to a DCP prefill: a
class's stabbing prefers ranks that also hold pending state pieces, which then take them (a preference,
not a proof of minimality; brute force finds it minimal on every small MLA + Mamba topology,
``tests/test_cp.py``).
"""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np

from .errors import IncompatibleLayoutsError, LayoutError
from .layout import CacheGroup, CyclicShare, EngineLayout, shares_intersect

Rank = tuple[int, int]  # (pp_rank, stage rank = pcp_rank * tp + tp_rank)
Span = tuple[int, int]  # half-open [start, stop)


@dataclass(frozen=True, slots=True)
class Read:
    """Decode rank ``decode`` reads from prefill rank ``prefill``: group ``group``, the group's layers in
    the global layer range ``layers``, and for each component of the group (in
    ``CacheGroup.components`` order) the global unit range ``units[i]`` (empty ``(0, 0)`` if none)."""

    decode: Rank
    prefill: Rank
    group: str
    layers: Span
    units: tuple[Span, ...]
    tokens: tuple[CyclicShare, ...] = ()  # the read moves only tokens in every one of these (none: all)

    def __str__(self) -> str:
        u = ",".join(f"{a}:{b}" for a, b in self.units)
        t = (" t[" + "&".join(str(s) for s in self.tokens) + "]") if self.tokens else ""
        return (f"D[pp{self.decode[0]},tp{self.decode[1]}] <- P[pp{self.prefill[0]},tp{self.prefill[1]}] "
                f"{self.group} L{self.layers[0]}:{self.layers[1]} u[{u}]{t}")


def share_fraction(shares: Iterable[CyclicShare]) -> float:
    """Fraction of all tokens that lie in every share (1.0 for none)."""
    shares = tuple(shares)
    if not shares:
        return 1.0
    period = math.lcm(*(s.period for s in shares))
    t = np.arange(period, dtype=np.int64)
    m = np.ones(period, dtype=bool)
    for s in shares:
        m &= s.holds(t)
    return float(m.sum()) / period


@dataclass(frozen=True, slots=True)
class TransferPlan:
    prefill: EngineLayout
    decode: EngineLayout
    reads: tuple[Read, ...]

    def reads_for(self, decode_rank: Rank) -> tuple[Read, ...]:
        return tuple(r for r in self.reads if r.decode == decode_rank)

    def prefill_ranks_for(self, decode_rank: Rank) -> tuple[Rank, ...]:
        return tuple(sorted({r.prefill for r in self.reads if r.decode == decode_rank}))

    def readers_of(self, prefill_rank: Rank) -> tuple[Rank, ...]:
        """Decode ranks that read from ``prefill_rank`` (each sends it one notification per request)."""
        return tuple(sorted({r.decode for r in self.reads if r.prefill == prefill_rank}))

    def notifiers_of(self, prefill_rank: Rank) -> tuple[Rank, ...]:
        """Decode ranks that tell ``prefill_rank`` a request is done, so it can free the blocks.

        Its readers; or, when nobody reads it (its data is a replica read elsewhere, e.g. MLA with
        prefill tp > decode tp), one designated decode rank: the natural partner on the decode stage
        that holds the prefill stage's first layer.
        """
        readers = self.readers_of(prefill_rank)
        if readers:
            return readers
        ppp, ptp = prefill_rank
        first_layer = self.prefill.pp_layers[ppp][0]  # type: ignore[index]
        return ((self.decode.stage_of_layer(first_layer),
                 ptp * self.decode.ranks_per_stage // self.prefill.ranks_per_stage),)

    def ranks_to_notify(self, decode_rank: Rank) -> tuple[Rank, ...]:
        """Prefill ranks ``decode_rank`` handshakes with and notifies: those it reads, plus unread ones
        it is the designated notifier of."""
        return tuple(p for p in self.prefill.ranks() if decode_rank in self.notifiers_of(p))

    def group_layers(self, read: Read) -> tuple[int, ...]:
        g = self.prefill.model.group(read.group)
        return tuple(l for l in g.layers if read.layers[0] <= l < read.layers[1])

    def read_bytes(self, read: Read) -> int:
        """Bytes of ``read`` per token it moves (per-token groups; see ``read.tokens``) or per request (Mamba)."""
        g = self.prefill.model.group(read.group)
        per_layer = sum((b - a) * c.unit_bytes for (a, b), c in zip(read.units, g.components))
        return per_layer * len(self.group_layers(read))


def check_compatible(prefill: EngineLayout, decode: EngineLayout) -> None:
    """Raise IncompatibleLayoutsError unless both engines serve the same cache geometry."""
    pm, dm = prefill.model, decode.model
    if pm.num_layers != dm.num_layers:
        raise IncompatibleLayoutsError(
            f"prefill model {pm.name!r} has {pm.num_layers} layers, decode model {dm.name!r} has {dm.num_layers}: "
            "both engines must serve the same model")
    pg = {g.name: g for g in pm.groups}
    dg = {g.name: g for g in dm.groups}
    if pg.keys() != dg.keys():
        raise IncompatibleLayoutsError(f"cache groups differ: prefill {sorted(pg)} vs decode {sorted(dg)}; "
                                       "both engines must serve the same model")
    for name, a in pg.items():
        b = dg[name]
        if a.dtype != b.dtype:
            raise IncompatibleLayoutsError(
                f"group {name!r}: prefill caches {a.dtype}, decode caches {b.dtype}; set the same kv-cache dtype")
        if a != b:
            raise IncompatibleLayoutsError(
                f"group {name!r} differs between prefill ({a!r}) and decode ({b!r}); serve the same model")


def _stab(intervals: list[tuple[int, int]], natural: int, rot: int,
          score: Callable[[int], int] | None = None) -> list[int]:
    """Minimum set of points hitting every closed interval ``[lo, hi]`` (greedy by right end).

    At each step any point in ``[L, e]`` hits the same intervals as ``e`` (L = largest left end of the
    remaining intervals that start by e), so we pick ``natural`` if it is there, else rotate by ``rot``;
    with ``score`` (point -> int, called once per pick), the highest-scoring point of ``[L, e]`` first.
    """
    remaining = sorted(set(intervals), key=lambda iv: (iv[1], iv[0]))
    points: list[int] = []
    while remaining:
        e = remaining[0][1]
        hit = [iv for iv in remaining if iv[0] <= e]
        lo = max(iv[0] for iv in hit)
        x = natural if lo <= natural <= e else lo + rot % (e - lo + 1)
        if score is not None:
            x = max(range(lo, e + 1), key=lambda p: (score(p), p == x))
        points.append(x)
        remaining = [iv for iv in remaining if not (iv[0] <= x <= iv[1])]
    return points


def _pieces(g: CacheGroup, prefill_tp: int, decode_tp: int,
            decode_tp_rank: int) -> Iterator[tuple[int, Span, tuple[int, int]]]:
    """Yield (component index, unit span to read, [lo, hi] interval of prefill tp ranks holding it)."""
    for ci, c in enumerate(g.components):
        need_lo, need_hi = c.unit_range(decode_tp, decode_tp_rank)
        if prefill_tp <= c.num_units:
            n = c.num_units // prefill_tp
            for p in range(need_lo // n, (need_hi - 1) // n + 1):
                yield ci, (max(need_lo, p * n), min(need_hi, p * n + n)), (p, p)
        else:
            reps = prefill_tp // c.num_units
            for u in range(need_lo, need_hi):
                yield ci, (u, u + 1), (u * reps, u * reps + reps - 1)


def _space(prefill: EngineLayout, k: int | None, natural: int) -> tuple[int, ...]:
    """Stage ranks that may supply class ``k`` (a prefill DCP rank; None: a group stored whole), in TP
    order, each TP rank at most once: for ``None`` the PCP copy of the natural partner."""
    tp = prefill.tp
    if k is None:
        c = prefill.pcp_rank(natural)
        return tuple(c * tp + t for t in range(tp))
    ranks = sorted((r for r in range(prefill.ranks_per_stage) if prefill.dcp_rank(r) == k), key=prefill.tp_rank)
    assert len({prefill.tp_rank(r) for r in ranks}) == len(ranks), "one TP rank per DCP class"
    return tuple(ranks)


# a piece of one prefill stage's reads for one decode rank: (group, component index, unit span, DCP class
# (None: stored whole), token shares, [lo, hi] interval of the class's space holding it)
_Piece = tuple[CacheGroup, int, Span, "int | None", tuple[CyclicShare, ...], tuple[int, int]]


@cache
def plan_transfer(prefill: EngineLayout, decode: EngineLayout) -> TransferPlan:
    """Compute the reads of every decode rank. Pure and cached on the (hashable) layouts."""
    check_compatible(prefill, decode)
    reads: list[Read] = []
    load: dict[Rank, int] = {}
    for dpp, dr in decode.ranks():
        ds, de = decode.stages[dpp]
        natural = dr * prefill.ranks_per_stage // decode.ranks_per_stage
        for ppp, (ps, pe) in enumerate(prefill.stages):
            lo_l, hi_l = max(ds, ps), min(de, pe)
            if lo_l >= hi_l:
                continue
            groups = [g for g in prefill.model.groups if any(lo_l <= l < hi_l for l in g.layers)]
            if not groups:
                continue
            spaces, pieces = _stage_pieces(prefill, decode, groups, dr, natural)
            points = _choose_points(prefill, spaces, pieces, natural, dr + ppp)
            reads += _assign(spaces, pieces, points, groups, (dpp, dr), ppp, (lo_l, hi_l), load)
    return TransferPlan(prefill, decode, tuple(reads))


def _stage_pieces(prefill: EngineLayout, decode: EngineLayout, groups: list[CacheGroup], dr: int,
                  natural: int) -> tuple[dict[int | None, tuple[int, ...]], list[_Piece]]:
    """The pieces decode rank ``dr`` reads from one prefill stage, per DCP class, and each class's space
    (the stage ranks that may supply it, :func:`_space`)."""
    dtp = decode.tp_rank(dr)
    spaces: dict[int | None, tuple[int, ...]] = {}
    pieces: list[_Piece] = []
    for g in groups:
        d_share = decode.token_share(g, dr)
        classes: list[tuple[int | None, CyclicShare | None]] = (
            [(k, CyclicShare(prefill.cp_interleave, k, prefill.dcp)) for k in range(prefill.dcp)]
            if prefill.token_sharded(g) else [(None, None)])
        for k, p_share in classes:
            shares = tuple(sorted({s for s in (d_share, p_share) if s is not None}))
            if not shares_intersect(shares):
                continue
            space = spaces.setdefault(k, _space(prefill, k, natural))
            ts = [prefill.tp_rank(r) for r in space]
            for ci, span, (lo, hi) in _pieces(g, prefill.tp, decode.tp, dtp):
                a, b = bisect_left(ts, lo), bisect_right(ts, hi) - 1
                if a > b:  # excluded by EngineLayout's coverage check
                    raise LayoutError(f"{prefill}: no rank of DCP class {k} holds units {span} of group "
                                      f"{g.name!r}")
                pieces.append((g, ci, span, k, shares, (a, b)))
    return spaces, pieces


def _choose_points(prefill: EngineLayout, spaces: dict[int | None, tuple[int, ...]], pieces: list[_Piece],
                   natural: int, rot: int) -> dict[int | None, list[int]]:
    """{DCP class: indices into its space of the ranks read}, the fewest that hold every piece (:func:`_stab`),
    ranks chosen for one class reused by the others."""
    chosen_ranks: list[int] = []
    points: dict[int | None, list[int]] = {}
    nat_t = prefill.tp_rank(natural)
    # state pieces next to token classes (Mamba in a DCP prefill): the holders (stage ranks) of each;
    # a class's stabbing prefers ranks that also hold pending state pieces, which then take them
    pending = ([{spaces[None][i] for i in range(a, b + 1)} for *_, kk, _s, (a, b) in pieces if kk is None]
               if None in spaces and len(spaces) > 1 else [])
    for k in sorted(spaces, key=lambda k: (k is None, k if k is not None else 0)):
        space = spaces[k]
        ivs = [iv for *_, kk, _s, iv in pieces if kk == k]
        have = [i for i, r in enumerate(space) if r in chosen_ranks]
        todo = [iv for iv in ivs if not any(lo <= i <= hi for i in have for lo, hi in [iv])]
        nat = min(bisect_left([prefill.tp_rank(r) for r in space], nat_t), len(space) - 1)

        def score(i: int, space: tuple[int, ...] = space, pending: list[set[int]] = pending) -> int:
            return sum(space[i] in h for h in pending)
        new_pts = _stab(todo, nat, rot, score if pending and k is not None else None) if todo else []
        pts = have + [p for p in new_pts if p not in have]
        points[k] = pts
        chosen_ranks += [space[i] for i in pts if space[i] not in chosen_ranks]
        pending = [h for h in pending if not h.intersection(chosen_ranks)]
    return points


def _assign(spaces: dict[int | None, tuple[int, ...]], pieces: list[_Piece], points: dict[int | None, list[int]],
            groups: list[CacheGroup], decode_rank: Rank, ppp: int, layers: tuple[int, int],
            load: dict[Rank, int]) -> list[Read]:
    """The reads: each piece from one chosen rank holding it (the least loaded so far, ``load`` updated)."""
    chosen: dict[tuple[int, str], tuple[list[Span], tuple[CyclicShare, ...]]] = {}
    picked: dict[tuple[str, int | None, int, int], int] = {}
    for g, ci, span, k, shares, (lo, hi) in pieces:
        # several chosen ranks may hold a replicated piece: give it to the least loaded one,
        # the same one for every component of the group (K next to V)
        space = spaces[k]
        x = picked.get((g.name, k, lo, hi))
        if x is None:
            holders = [space[i] for i in points[k] if lo <= i <= hi]
            x = picked[(g.name, k, lo, hi)] = min(holders, key=lambda t: (load.get((ppp, t), 0), t))
        load[(ppp, x)] = load.get((ppp, x), 0) + (span[1] - span[0]) * g.components[ci].unit_bytes
        entry = chosen.setdefault((x, g.name), ([(0, 0)] * len(g.components), shares))
        assert entry[1] == shares, "a prefill rank is in one DCP class"
        assert entry[0][ci] == (0, 0), "a prefill rank holds one piece per component"
        entry[0][ci] = span
    order = [g.name for g in groups]
    return [Read(decode_rank, (ppp, x), gname, layers, tuple(units), shares)
            for (x, gname), (units, shares) in sorted(chosen.items(), key=lambda kv: (kv[0][0], order.index(kv[0][1])))]


def plan_to_json(plan: TransferPlan) -> dict[str, Any]:
    """The plan in the documented JSON schema (ranges are half-open ``[start, stop)``)."""
    model = plan.prefill.model
    reads: list[dict[str, Any]] = []
    out: dict[str, Any] = {
        "model": model.name,
        "groups": [{"name": g.name, "kind": g.kind, "layers": list(g.layers),
                    "num_heads": g.num_heads} for g in model.groups],
        "prefill": _engine_json(plan.prefill),
        "decode": _engine_json(plan.decode),
        "reads": reads,
    }
    cp = any(e.pcp > 1 or e.dcp > 1 for e in (plan.prefill, plan.decode))
    for r in plan.reads:
        g = model.group(r.group)
        hc = g.head_component
        heads = None
        if hc is not None:
            span = r.units[g.components.index(hc)]
            heads = list(span) if span != (0, 0) else None
        b = plan.read_bytes(r)
        reads.append({
            "decode": {"pp": r.decode[0], "tp": r.decode[1]},
            "prefill": {"pp": r.prefill[0], "tp": r.prefill[1]},
            "group": r.group, "layers": list(r.layers), "heads": heads,
            "bytes_per_token": b if g.per_token else None,
            "bytes_per_request": None if g.per_token else b,
        })
        if cp:  # context parallelism on either side: the token share each read moves
            reads[-1] |= {"tokens": [{"interleave": t.interleave, "rank": t.rank, "size": t.size} for t in r.tokens],
                          "token_fraction": share_fraction(r.tokens)}
    return out


def _engine_json(e: EngineLayout) -> dict[str, Any]:
    """One engine in the plan's JSON: TP/PP, and with context parallelism each rank's token share."""
    d: dict[str, Any] = {"tp": e.tp, "pp": e.pp, "pp_layers": [list(x) for x in e.stages]}
    if e.pcp > 1 or e.dcp > 1:
        d |= {"pcp": e.pcp, "dcp": e.dcp, "cp_interleave": e.cp_interleave,
              "ranks": [{"pp": p, "rank": r, "tp_rank": e.tp_rank(r), "pcp_rank": e.pcp_rank(r),
                         "dcp_rank": e.dcp_rank(r),
                         "tokens": None if e.dcp == 1 else {"interleave": e.cp_interleave, "rank": e.dcp_rank(r),
                                                            "size": e.dcp}} for p, r in e.ranks()]}
    return d
