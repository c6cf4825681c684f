"""Cost model: direct head-sliced reads or staged (pack, one contiguous read, scatter)?

Direct reads post one descriptor per contiguous run; NIXL charges ``per_desc_us`` per descriptor on
top of the wire time. Staged transfers gather the runs into a contiguous buffer on the prefill side,
read it with a few large descriptors, and scatter on the decode side: two extra copies at
``copy_gbps``. For each (decode rank, prefill rank) pair the model compares, per full block:

    direct = runs * per_desc_us + bytes / wire_gbps
    staged = bytes / wire_gbps + 2 * bytes / copy_gbps + runs * gather_ns_per_run

Defaults are the figures measured on the reference CPU machine (shared/research/nixl_cpu.md):
~4.5 us per descriptor, ~10 GB/s for both memcpy and large NIXL reads. ``kvbridge bench --calibrate``
measures them on the current machine.

**Paths.** Each (decode rank, prefill rank) pair moves a request over one :class:`TransferPath`: a direct
READ of the KV memory, a READ of device staging buffers (``staged``), or a READ of host staging buffers
(``host``: the prefill packs on its device and copies to a registered host buffer, the decode reads host
to host, copies to its device and scatters), or a WRITE by the prefill into the decode's staging (``push``:
pack, WRITE, scatter; the decode posts no READ). Where a handshake measured the link (:mod:`kvbridge.runtime.probe`)
the pair's :class:`LinkFigures` replace the machine-wide constants: per path, the per-descriptor cost and
GB/s of the READ (push: of the prefill's WRITE), the local copy rates, and a moving correction from completed transfers
(:meth:`PathFigures.observe`). :func:`choose_path` picks the fastest path predicted to end within the pin
bound (the prefill's ``pin_s``), or the fastest if none does.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .modes import TransferPath
from .plan import Rank, TransferPlan, share_fraction

CALIBRATION_FILE = Path(
    os.environ.get("KVBRIDGE_CALIBRATION", Path.home() / ".cache" / "kvbridge" / "calibration.json")
)


GATHER_NS_PER_RUN = 50.0


@dataclass(frozen=True, slots=True)
class CostModel:
    per_desc_us: float = 4.5
    wire_gbps: float = 10.0
    copy_gbps: float = 10.0
    gather_ns_per_run: float = GATHER_NS_PER_RUN
    source: str = "defaults (shared/research/nixl_cpu.md)"

    @classmethod
    def load(cls) -> "CostModel":
        """The calibration file's constants (``kvbridge bench --calibrate``), else the defaults. A file that
        is missing, unreadable or holds non-positive values gives the defaults; keys it lacks (older
        files) keep their defaults."""
        try:
            d = json.loads(CALIBRATION_FILE.read_text())
            if not isinstance(d, dict):
                return cls()
            vals = {k: float(d[k]) for k in ("per_desc_us", "wire_gbps", "copy_gbps", "gather_ns_per_run") if k in d}
            if any(not (v > 0 and v < float("inf")) for v in vals.values()):
                return cls()
            return cls(**vals, source=str(CALIBRATION_FILE))
        except (OSError, ValueError, KeyError, TypeError, AttributeError, OverflowError):
            return cls()

    def save(self) -> None:
        CALIBRATION_FILE.parent.mkdir(parents=True, exist_ok=True)
        CALIBRATION_FILE.write_text(json.dumps({"per_desc_us": self.per_desc_us, "wire_gbps": self.wire_gbps,
                                                "copy_gbps": self.copy_gbps,
                                                "gather_ns_per_run": self.gather_ns_per_run}))

    def direct_us(self, runs: float, nbytes: float) -> float:
        return runs * self.per_desc_us + nbytes / (self.wire_gbps * 1e3)

    def staged_us(self, runs: float, nbytes: float) -> float:
        return (
            nbytes / (self.wire_gbps * 1e3) + 2 * nbytes / (self.copy_gbps * 1e3) + runs * self.gather_ns_per_run / 1e3
        )


# fixed cost of one local copy (a pack, a scatter, a host bounce) where none was measured
COPY_FIXED_US = 20.0
# a moving estimate: each completed transfer moves a path's correction this far towards what it saw
OBSERVE_WEIGHT = 0.2
# only transfers predicted to take at least this long move the estimate (below it a request's fixed
# costs, a side-channel round trip and the engines' polling, outweigh the link)
OBSERVE_MIN_US = 2000.0
# a read's fixed cost on a path (``PathFigures.overhead_us``) is learned from the reads too small for the
# correction: it drops to a lower residual at once and rises this far towards a higher one (queueing behind
# other reads only ever adds time, so the lower envelope is the path's own cost)
OVERHEAD_RISE = 0.25
OVERHEAD_MAX_US = 1e6
# before any such read: a staged path's fixed cost over a direct read's (the prefill packs in its serving
# turn before it answers, the decode hands the scatter over and waits for it); learned from then on
STAGED_OVERHEAD_US = 500.0
# a correction never goes beyond these (one outlier cannot bury a path for good)
FACTOR_BOUNDS = (0.05, 50.0)


@dataclass(slots=True)
class PathFigures:
    """Measured constants of one path of one link: the READ's per-descriptor cost and bandwidth, the local
    copies the path adds (µs per MB moved: pack + scatter, and host bounces), and ``factor``, a moving
    ratio of observed to predicted times of completed transfers (1.0 until one completes)."""

    per_desc_us: float
    gbps: float
    copy_us_per_mb: float = 0.0
    measured: bool = False   # from a probe (else from the machine-wide cost model)
    copy_fixed_us: float = 0.0  # fixed cost of the local copies per READ descriptor (staged: one per segment)
    factor: float = 1.0
    observed: int = 0        # completed transfers folded into ``factor``
    last_gbps: float = 0.0   # the last completed transfer's effective GB/s (bytes / seconds)
    bound: bool = False      # measured as a bound: a probe transfer did not end in time (at most this fast)
    # a read's fixed cost on this path beyond its READ and copies (the side channel's round trip, the
    # prefill's packing turn, the scatter's hand-over), in µs: learned from completed small reads (their
    # time less the prediction; a lower envelope, ``OVERHEAD_RISE``). A staged read of 2 MiB on the CPU VM
    # costs ~2 ms more than a direct one that the READ and copy figures do not show.
    overhead_us: float = 0.0
    overhead_seen: int = 0   # completed small reads folded into ``overhead_us``

    def raw_us(self, descs: float, nbytes: float) -> float:
        """Predicted µs of moving ``nbytes`` in ``descs`` READ descriptors, before the correction."""
        return (descs * (self.per_desc_us + self.copy_fixed_us) + nbytes / (self.gbps * 1e3)
                + nbytes / 1e6 * self.copy_us_per_mb)

    def predict_us(self, descs: float, nbytes: float) -> float:
        """The READ and copies, corrected (a read's fixed cost is the link's: :meth:`LinkFigures.overhead_us`)."""
        return self.raw_us(descs, nbytes) * self.factor

    @property
    def overhead_known(self) -> bool:
        return self.overhead_seen >= 2  # (the first read is not counted)

    def observe(self, descs: float, nbytes: float, seconds: float, fixed: bool = True) -> None:
        """Fold one completed read (``seconds`` for ``nbytes`` in ``descs`` descriptors) into ``factor``;
        reads predicted under ``OBSERVE_MIN_US`` (their fixed costs dominate) into ``overhead_us`` instead,
        if ``fixed`` (the read ran alone: its time was not spent queueing behind others)."""
        raw = self.raw_us(descs, nbytes)
        if not seconds > 0 or not math.isfinite(seconds):
            return
        if raw < OBSERVE_MIN_US:
            if not fixed:
                return
            residual = min(max(seconds * 1e6 - raw * self.factor, 0.0), OVERHEAD_MAX_US)
            if self.overhead_seen == 0:
                pass  # a link's first read on a path pays its lazy connection and registration: not its cost
            elif self.overhead_seen == 1 or residual < self.overhead_us:
                self.overhead_us = residual
            else:
                self.overhead_us += OVERHEAD_RISE * (residual - self.overhead_us)
            self.overhead_seen += 1
            return
        ratio = min(max(seconds * 1e6 / raw, FACTOR_BOUNDS[0]), FACTOR_BOUNDS[1])
        self.factor = ratio if self.observed == 0 else (1 - OBSERVE_WEIGHT) * self.factor + OBSERVE_WEIGHT * ratio
        self.factor = min(max(self.factor, FACTOR_BOUNDS[0]), FACTOR_BOUNDS[1])
        self.observed += 1
        self.last_gbps = nbytes / seconds / 1e9

    @property
    def effective_gbps(self) -> float:
        """The READ's bandwidth after the correction (what the path delivers on large requests)."""
        return self.gbps / self.factor

    def to_json(self) -> dict[str, float | bool | int]:
        # bandwidths to 4 significant digits, not decimals: a link a stalled probe measured at 20 KB/s must
        # not read 0.0 GB/s (a fresh clone's e2e run exported exactly that)
        return {"gbps": _sig(self.gbps), "us_per_desc": round(self.per_desc_us, 3),
                "copy_us_per_mb": round(self.copy_us_per_mb, 3), "copy_fixed_us": round(self.copy_fixed_us, 3),
                "measured": self.measured, "bound": self.bound,
                "factor": round(self.factor, 4), "observed": self.observed,
                "overhead_us": round(self.overhead_us, 1), "overhead_seen": self.overhead_seen,
                "last_gbps": _sig(self.last_gbps)}


def _sig(x: float, digits: int = 4) -> float:
    """``x`` rounded to ``digits`` significant digits (0 and non-finite values as they are)."""
    return float(f"{x:.{digits}g}") if x and math.isfinite(x) else x


@dataclass(slots=True)
class LinkFigures:
    """What a decode rank knows of its link to one prefill rank: :class:`PathFigures` per available path,
    the prefill's pin bound (seconds a pin holds at most; a read predicted to run longer is avoided),
    and where the figures came from."""

    paths: dict[TransferPath, PathFigures] = field(default_factory=dict)
    pin_s: float = math.inf
    min_read_rate: float = math.inf  # bytes per second: the pin also holds for the request's bytes at this rate
    source: str = "cost model"
    probe_ms: float = 0.0     # the measured kinds' time
    probe_wall_ms: float = 0.0  # the measuring's wall time (within the probe_ms budget)
    probe_connect_ms: float = 0.0  # the warm-up transfers before it (UCX connects lazily), not in the budget
    probe_bytes: int = 0
    gather_ns_per_run: float = GATHER_NS_PER_RUN
    warning: str = ""         # the degraded-link warning, once it went out (once per link)
    device: str = "cpu"       # where the pair's KV memory lives ("cuda:N" on either side: a GPU link)

    def pin_bound_s(self, nbytes: float) -> float:
        """How long the prefill's pin holds for a read of ``nbytes`` at most (``pin_s`` plus the bytes at the
        slowest accepted rate; the lease's rule)."""
        return self.pin_s + nbytes / self.min_read_rate

    def overhead_us(self, path: TransferPath) -> float:
        """A read's fixed cost on ``path`` (µs): as its reads measured it; before that, a direct read's (as
        measured; else 0) plus :func:`overhead_prior` (so no path is tried only because it was never timed)."""
        f = self.paths[path]
        if f.overhead_known:
            return f.overhead_us
        d = self.paths.get(TransferPath.DIRECT)
        base = d.overhead_us if d is not None and d.overhead_known else 0.0
        return base + overhead_prior(path)

    def predict_us(self, path: TransferPath, runs: float, nbytes: float, segments: float = 1.0) -> float:
        f = self.paths[path]
        if path is TransferPath.DIRECT:
            moved = f.predict_us(runs, nbytes)
        else:  # the segments' READs, and gathering the runs into them
            moved = f.predict_us(max(segments, 1.0), nbytes) + runs * self.gather_ns_per_run / 1e3
        return moved + self.overhead_us(path)

    def predictions(self, runs: float, nbytes: float, segment_bytes: float = 64 << 20,
                    allowed: Collection[TransferPath] | None = None) -> dict[TransferPath, float]:
        segs = max(1.0, math.ceil(nbytes / max(segment_bytes, 1)))
        return {p: self.predict_us(p, runs, nbytes, segs) for p in self.paths if allowed is None or p in allowed}

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "device": self.device,
            "pin_s": self.pin_s if math.isfinite(self.pin_s) else None,
            "min_read_rate": self.min_read_rate if math.isfinite(self.min_read_rate) else None,
            "probe_ms": round(self.probe_ms, 3),
            "probe_wall_ms": round(self.probe_wall_ms, 3),
            "probe_connect_ms": round(self.probe_connect_ms, 3),
            "probe_bytes": self.probe_bytes,
            "paths": {p.value: f.to_json() for p, f in self.paths.items()},
            "warning": self.warning,
        }


def overhead_prior(path: TransferPath) -> float:
    """A path's fixed cost per read over a direct read's before any read measured it (µs)."""
    return 0.0 if path is TransferPath.DIRECT else STAGED_OVERHEAD_US


def model_link(model: "CostModel", paths: Collection[TransferPath] = (TransferPath.DIRECT, TransferPath.STAGED),
               pin_s: float = math.inf, min_read_rate: float = math.inf) -> LinkFigures:
    """A :class:`LinkFigures` from the machine-wide constants (no probe): every path reads at
    ``wire_gbps`` with ``per_desc_us`` per descriptor; staged paths add two copies at ``copy_gbps`` (host
    staging two more), each ``COPY_FIXED_US`` per segment."""
    copy = 1e3 / model.copy_gbps  # µs per MB of one copy
    copies = {TransferPath.DIRECT: 0, TransferPath.STAGED: 2, TransferPath.PUSH: 2, TransferPath.HOST: 4}
    return LinkFigures({TransferPath(p): PathFigures(model.per_desc_us, model.wire_gbps, copies[TransferPath(p)] * copy,
                                                     copy_fixed_us=copies[TransferPath(p)] * COPY_FIXED_US)
                        for p in paths}, pin_s=pin_s, min_read_rate=min_read_rate,
                       gather_ns_per_run=model.gather_ns_per_run)


def choose_path(link: LinkFigures, runs: float, nbytes: float, allowed: Collection[TransferPath] | None = None,
                segment_bytes: float = 64 << 20) -> tuple[TransferPath, dict[TransferPath, float]]:
    """The fastest of the link's paths (``allowed``: a subset) for ``runs`` descriptors of ``nbytes``,
    among those predicted to end within the pin bound (:meth:`LinkFigures.pin_bound_s`); the fastest
    overall when none fits.
    Returns (path, predicted µs per path)."""
    pred = link.predictions(runs, nbytes, segment_bytes, allowed)
    if not pred:
        return TransferPath.DIRECT, pred
    bound = link.pin_bound_s(nbytes)
    fits = {p: t for p, t in pred.items() if t / 1e6 <= bound}
    pool = fits or pred
    return min(pool, key=lambda p: (pool[p], list(TransferPath).index(p))), pred


def flip_points(link: LinkFigures, runs_per_byte: float, allowed: Collection[TransferPath] | None = None,
                lo: int = 4 << 10,
                hi: int = 64 << 30) -> list[tuple[int, TransferPath]]:
    """Request sizes (bytes) where the chosen path changes, for requests of ``runs_per_byte`` descriptors
    per byte: [(size from which, path)], the first entry at ``lo``."""
    out: list[tuple[int, TransferPath]] = []
    size = lo
    while size <= hi:
        p, _ = choose_path(link, size * runs_per_byte, size, allowed)
        if not out or out[-1][1] is not p:
            out.append((size, p))
        size *= 2
    return out


@dataclass(frozen=True, slots=True)
class ModeChoice:
    decode: Rank
    prefill: Rank
    runs_per_block: float
    bytes_per_run: int
    mode: TransferPath
    why: str


@dataclass(frozen=True, slots=True)
class PairShape:
    """Descriptor shape of one (decode rank, prefill rank) pair, per chunk of ``chunk_tokens`` tokens
    (per-token groups) and per request (Mamba state)."""

    runs_shuffled: float   # runs per chunk when consecutive chunks do not merge
    runs_contiguous: float  # extra runs per chunk when block ids are consecutive (after merging)
    bytes_per_chunk: float
    state_runs: float
    state_bytes: float

    def runs(self, chunks: float, consecutive: float = 0.0) -> float:
        """Descriptors for ``chunks`` chunks, ``consecutive`` (0..1) of them following their predecessor."""
        per = consecutive * self.runs_contiguous + (1 - consecutive) * self.runs_shuffled
        return chunks * per + self.state_runs

    def nbytes(self, chunks: float) -> float:
        return chunks * self.bytes_per_chunk + self.state_bytes


def pair_shapes(lp) -> dict:
    """:class:`PairShape` of each prefill rank of a :class:`~kvbridge.lower.LoweredPlan`."""
    out = {}
    for p, lows in lp.by_prefill.items():
        rs = rc = b = sr = sb = 0.0
        for low in lows:
            t = low.templates[low.chunk]
            if low.per_token:  # per chunk of lp.chunk_tokens tokens (a group's own chunk may be larger)
                # with context parallelism a read moves only the chunks in its token shares
                f = lp.chunk_tokens / low.chunk * (share_fraction(low.shares) if low.shares else 1.0)
                rs += t.nbytes.size * f
                rc += max(t.runs_two_chunks - t.nbytes.size, 0) * f
                b += float(t.nbytes.sum()) * f
            else:
                sr += t.nbytes.size
                sb += float(t.nbytes.sum())
        out[p] = PairShape(rs, rc, b, sr, sb)
    return out


def request_chunks(groups, decode_blocks: dict, prefill_blocks: dict, decode_block_size,
                   chunk_tokens: int) -> tuple[float, float]:
    """(chunks, consecutive fraction) of one request, from its largest per-token group: runs merge
    across consecutive block ids, so a request whose blocks are mostly consecutive on both sides posts
    far fewer descriptors than a shuffled one."""
    import numpy as np
    chunks, frac = 0.0, 0.0
    for g in groups:
        if not g.per_token or g.name not in decode_blocks:
            continue
        ids_d, ids_p = decode_blocks[g.name].block_ids, prefill_blocks[g.name].block_ids
        bsd = decode_block_size(g) if callable(decode_block_size) else decode_block_size
        eng = getattr(decode_block_size, "__self__", None)  # EngineLayout.block_size_of: a block-list entry
        if eng is not None and hasattr(eng, "scheduler_block_size"):  # spans block_size x dcp tokens with DCP
            bsd = eng.scheduler_block_size(g)
        n = ids_d.size * bsd / chunk_tokens
        if n > chunks:
            chunks = n
            fd = float(np.mean(np.diff(ids_d) == 1)) if ids_d.size > 1 else 0.0
            fp = float(np.mean(np.diff(ids_p) == 1)) if ids_p.size > 1 else 0.0
            frac = min(fd, fp)
    return chunks, frac


def request_modes(model: "CostModel", shapes: dict, chunks: float, frac: float, can_stage,
                  links: dict | None = None, paths_of=None) -> dict[Rank, TransferPath]:
    """Auto mode, per request: the path of each prefill rank in ``shapes``. ``can_stage(p)``: the pair has
    a staging path; ``links``: measured :class:`LinkFigures` per prefill rank (else ``model``'s constants);
    ``paths_of(p)``: the paths the pair offers (default direct and device staging)."""
    out: dict[Rank, TransferPath] = {}
    for p, shape in shapes.items():
        if not can_stage(p):
            out[p] = TransferPath.DIRECT
            continue
        runs, nbytes = shape.runs(chunks, frac), shape.nbytes(chunks)
        link = (links or {}).get(p)
        if link is None:
            out[p] = pick(model, runs, nbytes)
            continue
        allowed = paths_of(p) if paths_of is not None else None
        out[p] = choose_path(link, runs, nbytes, allowed)[0]
    return out


def pick(model: CostModel, runs: float, nbytes: float) -> TransferPath:
    staged = model.staged_us(runs, nbytes) < model.direct_us(runs, nbytes)
    return TransferPath.STAGED if staged else TransferPath.DIRECT


def choose_modes(plan: TransferPlan, model: CostModel | None = None, shuffled: bool = True,
                 decode_ranks=None, links: dict | None = None) -> list[ModeChoice]:
    """Pick direct or staged for each (decode rank, prefill rank) pair of ``plan``, per block.

    ``shuffled``: assume block ids are not consecutive (the common case in a busy engine), so runs do
    not merge across blocks; otherwise count the runs left after merging consecutive blocks. At run
    time, ``auto`` mode re-decides per request from the request's own block ids
    (:meth:`PairShape.runs`).
    """
    from .lower import LoweredPlan
    model = model or CostModel.load()
    out = []
    bs = max(plan.prefill.block_size, plan.decode.block_size)
    for d in decode_ranks if decode_ranks is not None else plan.decode.ranks():
        lp = LoweredPlan(plan, d)
        for p, shape in pair_shapes(lp).items():
            chunks = bs / lp.chunk_tokens if shape.bytes_per_chunk else 0
            runs = shape.runs(chunks, 0.0 if shuffled else 1.0) - shape.state_runs
            nbytes = shape.nbytes(chunks) - shape.state_bytes
            if runs <= 0:
                continue
            link = (links or {}).get(p)
            if link is not None:  # measured figures of this pair
                mode, pred = choose_path(link, runs, nbytes)
                why = (f"per block ({link.source}): " + ", ".join(
                    f"{q.value} {t:.1f} us" for q, t in sorted(pred.items(), key=lambda qt: qt[1])))
                out.append(ModeChoice(d, p, runs, int(nbytes / runs), mode, why))
                continue
            direct, staged = model.direct_us(runs, nbytes), model.staged_us(runs, nbytes)
            mode = pick(model, runs, nbytes)
            why = (f"per block: direct {direct:.1f} us ({runs:.0f} descs x {model.per_desc_us} us + wire) vs "
                   f"staged {staged:.1f} us (wire + 2 copies at {model.copy_gbps} GB/s)")
            out.append(ModeChoice(d, p, runs, int(nbytes / runs), mode, why))
    return out
