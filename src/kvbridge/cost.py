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
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from .plan import Rank, TransferPlan, share_fraction

CALIBRATION_FILE = Path(os.environ.get("KVBRIDGE_CALIBRATION", Path.home() / ".cache" / "kvbridge" / "calibration.json"))


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
        return nbytes / (self.wire_gbps * 1e3) + 2 * nbytes / (self.copy_gbps * 1e3) + runs * self.gather_ns_per_run / 1e3


@dataclass(frozen=True, slots=True)
class ModeChoice:
    decode: Rank
    prefill: Rank
    runs_per_block: float
    bytes_per_run: int
    mode: str
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


def request_modes(model: "CostModel", shapes: dict, chunks: float, frac: float, can_stage) -> dict:
    """Auto mode, per request: direct or staged for each prefill rank in ``shapes`` (``can_stage(p)``:
    the pair has a staging path)."""
    return {p: (pick(model, shape.runs(chunks, frac), shape.nbytes(chunks)) if can_stage(p) else "direct")
            for p, shape in shapes.items()}


def pick(model: CostModel, runs: float, nbytes: float) -> str:
    return "staged" if model.staged_us(runs, nbytes) < model.direct_us(runs, nbytes) else "direct"


def choose_modes(plan: TransferPlan, model: CostModel | None = None, shuffled: bool = True,
                 decode_ranks=None) -> list[ModeChoice]:
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
            direct, staged = model.direct_us(runs, nbytes), model.staged_us(runs, nbytes)
            mode = pick(model, runs, nbytes)
            why = (f"per block: direct {direct:.1f} us ({runs:.0f} descs x {model.per_desc_us} us + wire) vs "
                   f"staged {staged:.1f} us (wire + 2 copies at {model.copy_gbps} GB/s)")
            out.append(ModeChoice(d, p, runs, int(nbytes / runs), mode, why))
    return out
