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
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from .errors import IncompatibleLayoutsError
from .layout import CacheGroup, EngineLayout

Rank = tuple[int, int]  # (pp_rank, tp_rank)
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

    def __str__(self) -> str:
        u = ",".join(f"{a}:{b}" for a, b in self.units)
        return (f"D[pp{self.decode[0]},tp{self.decode[1]}] <- P[pp{self.prefill[0]},tp{self.prefill[1]}] "
                f"{self.group} L{self.layers[0]}:{self.layers[1]} u[{u}]")


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
        return ((self.decode.stage_of_layer(first_layer), ptp * self.decode.tp // self.prefill.tp),)

    def ranks_to_notify(self, decode_rank: Rank) -> tuple[Rank, ...]:
        """Prefill ranks ``decode_rank`` handshakes with and notifies: those it reads, plus unread ones
        it is the designated notifier of."""
        return tuple(p for p in self.prefill.ranks() if decode_rank in self.notifiers_of(p))

    def group_layers(self, read: Read) -> tuple[int, ...]:
        g = self.prefill.model.group(read.group)
        return tuple(l for l in g.layers if read.layers[0] <= l < read.layers[1])

    def read_bytes(self, read: Read) -> int:
        """Bytes of ``read`` per token (per-token groups) or per request (Mamba)."""
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


def _stab(intervals: list[tuple[int, int]], natural: int, rot: int) -> list[int]:
    """Minimum set of points hitting every closed interval ``[lo, hi]`` (greedy by right end).

    At each step any point in ``[L, e]`` hits the same intervals as ``e`` (L = largest left end of the
    remaining intervals that start by e), so we pick ``natural`` if it is there, else rotate by ``rot``.
    """
    remaining = sorted(set(intervals), key=lambda iv: (iv[1], iv[0]))
    points: list[int] = []
    while remaining:
        e = remaining[0][1]
        hit = [iv for iv in remaining if iv[0] <= e]
        lo = max(iv[0] for iv in hit)
        x = natural if lo <= natural <= e else lo + rot % (e - lo + 1)
        points.append(x)
        remaining = [iv for iv in remaining if not (iv[0] <= x <= iv[1])]
    return points


def _pieces(g: CacheGroup, prefill_tp: int, decode_tp: int, decode_tp_rank: int):
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


@cache
def plan_transfer(prefill: EngineLayout, decode: EngineLayout) -> TransferPlan:
    """Compute the reads of every decode rank. Pure and cached on the (hashable) layouts."""
    check_compatible(prefill, decode)
    reads: list[Read] = []
    load: dict[Rank, int] = {}
    for dpp, dtp in decode.ranks():
        ds, de = decode.pp_layers[dpp]  # type: ignore[index]
        for ppp, (ps, pe) in enumerate(prefill.pp_layers):  # type: ignore[arg-type]
            lo_l, hi_l = max(ds, ps), min(de, pe)
            if lo_l >= hi_l:
                continue
            groups = [g for g in prefill.model.groups if any(lo_l <= l < hi_l for l in g.layers)]
            if not groups:
                continue
            pieces = [(g, ci, span, iv) for g in groups for ci, span, iv in _pieces(g, prefill.tp, decode.tp, dtp)]
            natural = dtp * prefill.tp // decode.tp
            points = _stab([iv for *_, iv in pieces], natural, dtp + ppp)
            chosen: dict[tuple[int, str], list[Span]] = {}
            picked: dict[tuple[str, int, int], int] = {}
            for g, ci, span, (lo, hi) in pieces:
                # several chosen ranks may hold a replicated piece: give it to the least loaded one,
                # the same one for every component of the group (K next to V)
                x = picked.get((g.name, lo, hi))
                if x is None:
                    holders = [x for x in points if lo <= x <= hi]
                    x = picked[(g.name, lo, hi)] = min(holders, key=lambda t: (load.get((ppp, t), 0), t))
                load[(ppp, x)] = load.get((ppp, x), 0) + (span[1] - span[0]) * g.components[ci].unit_bytes
                units = chosen.setdefault((x, g.name), [(0, 0)] * len(g.components))
                assert units[ci] == (0, 0), "a prefill rank holds one piece per component"
                units[ci] = span
            for (x, gname), units in sorted(chosen.items(), key=lambda kv: (kv[0][0], [g.name for g in groups].index(kv[0][1]))):
                reads.append(Read((dpp, dtp), (ppp, x), gname, (lo_l, hi_l), tuple(units)))
    return TransferPlan(prefill, decode, tuple(reads))


def plan_to_json(plan: TransferPlan) -> dict:
    """The plan in the documented JSON schema (ranges are half-open ``[start, stop)``)."""
    model = plan.prefill.model
    out = {
        "model": model.name,
        "groups": [{"name": g.name, "kind": g.kind, "layers": list(g.layers),
                    "num_heads": g.num_heads} for g in model.groups],
        "prefill": {"tp": plan.prefill.tp, "pp": plan.prefill.pp, "pp_layers": [list(x) for x in plan.prefill.pp_layers]},
        "decode": {"tp": plan.decode.tp, "pp": plan.decode.pp, "pp_layers": [list(x) for x in plan.decode.pp_layers]},
        "reads": [],
    }
    for r in plan.reads:
        g = model.group(r.group)
        hc = g.head_component
        heads = None
        if hc is not None:
            span = r.units[g.components.index(hc)]
            heads = list(span) if span != (0, 0) else None
        b = plan.read_bytes(r)
        out["reads"].append({
            "decode": {"pp": r.decode[0], "tp": r.decode[1]},
            "prefill": {"pp": r.prefill[0], "tp": r.prefill[1]},
            "group": r.group, "layers": list(r.layers), "heads": heads,
            "bytes_per_token": b if g.per_token else None,
            "bytes_per_request": None if g.per_token else b,
        })
    return out
