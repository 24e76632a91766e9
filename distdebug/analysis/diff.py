"""Offline fingerprint diffs from run directories: rank against rank at a step, the first divergent
step, and run against run (the reproducibility check).

Snapshots are loaded as numpy arrays (``fingerprint.snapshots``); a step's comparison is one
vectorised ``!=`` over a ranks x tensors matrix, and only differing columns are looked at in
Python, so thousands of ranks with thousands of tensors diff in seconds.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from distdebug.artifacts import layout, retention, schema
from distdebug.errors import UserError
from distdebug.fingerprint.compare import compare, odd_ones_out, split_group
from distdebug.fingerprint.snapshots import (
    BLOCK,
    Block,
    blocks_of,
    merge_blocks,
    read_after,
    read_blocks_file,
    read_roots,
    read_stream,
    root,
)

Snapshots = dict[int, dict[int, tuple[list[str], np.ndarray]]]  # rank -> step -> (names, values)
Roots = dict[int, dict[int, tuple[tuple[str, ...], int]]]  # rank -> thinned step -> (names, digest of them all)
THINNED = "(every tensor: this step was thinned to one digest; which tensor differs is not kept)"
"""The tensor a thinned step's difference names (artifacts.retention: past the ring, a step's fingerprints
are kept as one digest, unless a finding pinned it)."""


def load_snapshots(run_dir: Path, roots: Roots | None = None) -> Snapshots:
    """All ranks' snapshots (every file of their rotated streams); identical name files (the usual case) are
    parsed once. ``roots``: filled with the digests of the thinned steps."""
    out: Snapshots = {}
    for rank, child, lists in _with_names(run_dir, {}):
        out[rank] = read_stream(child, lists)
        if roots is not None:
            roots[rank] = read_roots(child, lists)
    if not out:
        raise UserError(f"no fingerprint snapshots in {run_dir}: was it run with the replica_divergence detector "
                        "(on by default) and did it reach a step?")
    return out


def _with_names(run_dir: Path, parsed: dict[bytes, list[list[str]]]) -> Iterator[tuple[int, Path, list[list[str]]]]:
    """Each rank folder with fingerprints, and its tensor name lists (identical files, the usual case, parsed
    once: ``parsed`` keeps them across calls)."""
    for rank, child in layout.rank_dirs(run_dir):
        try:
            raw = (child / layout.FINGERPRINT_NAMES).read_bytes()
        except FileNotFoundError:
            continue
        lists = parsed.get(raw)
        if lists is None:
            lists = parsed[raw] = json.loads(raw)["names"]
        yield rank, child, lists


@dataclass
class TensorDiff:
    tensor: str
    ranks: list[int]
    """Odd ones out by majority (3+ ranks), or every rank involved when there is none."""
    groups: list[list[int]]
    """Ranks grouped by equal fingerprint."""
    by_majority: bool
    replica_group: list[int] | None = None
    """The ranks that must agree on this tensor (an HSDP replicate group); None: every rank."""

    def to_dict(self) -> dict[str, Any]:
        return {"tensor": self.tensor, "ranks": self.ranks, "groups": self.groups, "by_majority": self.by_majority,
                "replica_group": self.replica_group}


def steps_of(snaps: Snapshots) -> list[int]:
    return sorted(set().union(*(set(s) for s in snaps.values())))


def diff_step(snaps: Snapshots, step: int) -> list[TensorDiff]:
    """Tensors whose fingerprints differ across the ranks that checked ``step``."""
    rows = {r: s[step] for r, s in snaps.items() if step in s}
    if len(rows) < 2:
        return []
    names0 = next(iter(rows.values()))[0]
    if all(n is names0 or n == names0 for n, _ in rows.values()):
        ranks = sorted(rows)
        matrix = np.stack([rows[r][1] for r in ranks])
        cols = np.nonzero((matrix != matrix[0]).any(axis=0))[0]
        per_col = [(names0[c], {r: int(v) for r, v in zip(ranks, matrix[:, c], strict=True)}) for c in cols]
    else:  # names differ between ranks (a tensor missing somewhere, HSDP replica groups): by name
        maps = {r: dict(zip(n, v.tolist(), strict=True)) for r, (n, v) in rows.items()}
        order = list(dict.fromkeys(n for names, _ in rows.values() for n in names))
        return [TensorDiff(d["tensor"], d["ranks"], d["groups"], d["by_majority"], d["replica_group"])
                for d in compare(maps, order)]
    diffs = []
    for name, values in per_col:
        odd, majority = odd_ones_out(values)
        groups: dict[int, list[int]] = {}
        for r, v in sorted(values.items()):
            groups.setdefault(v, []).append(r)
        diffs.append(TensorDiff(name, odd, sorted(groups.values()), majority))
    return diffs


def first_divergent_step(snaps: Snapshots, roots: Roots | None = None) -> tuple[int, list[TensorDiff]] | None:
    """The first step where ranks differ: a whole step's tensors, or a thinned step's digests."""
    thinned = sorted(set().union(*(set(r) for r in roots.values()))) if roots else []
    for step in sorted(set(steps_of(snaps)) | set(thinned)):
        diffs = diff_step(snaps, step) or (diff_thinned(roots, step, snaps) if roots else [])
        if diffs:
            return step, diffs
    return None


def diff_thinned(roots: Roots, step: int, snaps: Snapshots | None = None) -> list[TensorDiff]:
    """A step some rank thinned: ranks grouped by the digest of all their tensors (a rank that kept the step
    whole, as the one whose finding pinned it, digested here), among ranks that digested the same names (a
    tensor set that differs by design, as between replica groups, is not a difference)."""
    rows = {r: d for r in set(roots) | set(snaps or {}) if (d := _digest(snaps or {}, roots, r, step)) is not None}
    if not any(step in s for s in roots.values()):
        return []
    by_names: dict[tuple[str, ...], dict[int, int]] = {}
    for rank, (names, digest) in rows.items():
        by_names.setdefault(names, {})[rank] = digest
    for values in sorted(by_names.values(), key=len, reverse=True):
        if len(set(values.values())) > 1:
            odd, majority = odd_ones_out(values)
            groups: dict[int, list[int]] = {}
            for r, v in sorted(values.items()):
                groups.setdefault(v, []).append(r)
            return [TensorDiff(THINNED, odd, sorted(groups.values()), majority)]
    return []


@dataclass
class RunDiff:
    step: int
    rank: int
    tensors: list[str]


def diff_runs(a: Snapshots, b: Snapshots, ra: Roots | None = None, rb: Roots | None = None) \
        -> tuple[RunDiff | None, int]:
    """First (step, rank) where run B differs from run A, and how many (rank, step) pairs were compared; a
    step one of them thinned is compared by its digest (``ra``, ``rb``: the runs' roots)."""
    compared = 0
    ra, rb = ra or {}, rb or {}
    steps = (set(steps_of(a)) | set().union(*map(set, ra.values()))) & \
        (set(steps_of(b)) | set().union(*map(set, rb.values())))
    for step in sorted(steps):
        for rank in sorted(set(a) & set(b)):
            if step not in a[rank] or step not in b[rank]:
                da = _digest(a, ra, rank, step)
                db = _digest(b, rb, rank, step)
                if da is None or db is None:
                    continue
                compared += 1
                if da != db:
                    return RunDiff(step, rank, [THINNED]), compared
                continue
            compared += 1
            (na, va), (nb, vb) = a[rank][step], b[rank][step]
            if na == nb and np.array_equal(va, vb):
                continue
            ma, mb = dict(zip(na, va.tolist(), strict=True)), dict(zip(nb, vb.tolist(), strict=True))
            names = [split_group(n)[0] for n in dict.fromkeys(na + nb) if ma.get(n) != mb.get(n)]
            return RunDiff(step, rank, names), compared
    return None, compared


def _other_names(snaps: Snapshots, roots: Roots, step: int) -> list[list[int]]:
    """At a thinned step, the groups of ranks that digested different tensors (a replica group's own, or a
    tensor missing on some rank): their digests cannot be compared; the largest group is the one compared."""
    if not any(step in r for r in roots.values()):
        return []
    by_names: dict[tuple[str, ...], list[int]] = {}
    for rank in sorted(set(roots) | set(snaps)):
        d = _digest(snaps, roots, rank, step)
        if d is not None:
            by_names.setdefault(d[0], []).append(rank)
    groups = sorted(by_names.values(), key=len, reverse=True)
    return groups[1:] if len(groups) > 1 else []


def _digest(snaps: Snapshots, roots: Roots, rank: int, step: int) -> tuple[tuple[str, ...], int] | None:
    """A rank's step as (names, digest of all its fingerprints), whole or thinned; None when not kept."""
    if step in snaps.get(rank, {}):
        names, values = snaps[rank][step]
        return tuple(names), root(np.ascontiguousarray(values).tobytes())
    return roots.get(rank, {}).get(step)


# ---------------------------------------------------------------- at scale: through the blocks
BLOCKS_FROM_BYTES = 256 << 20
"""Fingerprint files larger than this in all are diffed through their blocks (a thousand ranks' snapshots are
hundreds of GB); smaller ones are read whole, as they always were."""


class Scaled:
    """Every rank's fingerprint blocks (fingerprint.snapshots.BlockWriter), with the steps no block covers yet
    made into blocks here: ranks whose blocks agree agree at every step of the block, so the first block where
    they do not is found from a few KB a rank, and only one rank per distinct block (its class) is then read,
    and only for that block's steps."""

    def __init__(self, dirs: list[Path]) -> None:
        self.folders: dict[int, Path] = {}
        self.lists: dict[int, list[list[str]]] = {}
        self.blocks: dict[int, dict[int, list[Block]]] = {}  # rank -> key -> its blocks at the common width
        self.width = BLOCK
        self._whole: dict[int, tuple[dict, dict]] = {}
        self.pins: dict[int, retention.Pins] = {}
        """Each rank's pinned steps (its findings' neighbourhoods: kept whole past the ring, not as a digest)."""
        parsed: dict[bytes, list[list[str]]] = {}
        raw: dict[int, list[Block]] = {}
        for run_dir in dirs:
            for rank, child, lists in _with_names(run_dir, parsed):
                blocks = read_blocks_file(child / layout.FINGERPRINT_BLOCKS)  # OSError: none (an older run)
                seg, offset = max(((b.seg, b.offset) for b in blocks), default=(0, 0))  # the last flush
                tail = read_after(child, lists, seg, offset)
                if tail is None:
                    raise ValueError("the steps after the last block were thinned")
                blocks += blocks_of(tail, lists, BLOCK)
                seen: dict[int, int] = {}
                for b in blocks:
                    if b.first <= seen.get(b.nid, -1):
                        raise ValueError("a restarted rank's steps repeat")  # which attempt's step: read whole
                    seen[b.nid] = b.last
                self.folders[rank], self.lists[rank] = child, lists
                raw[rank] = blocks
        self.width = max([BLOCK] + [b.width for bs in raw.values() for b in bs])
        for rank, bs in raw.items():
            keyed: dict[int, list[Block]] = {}
            for b in merge_blocks(bs, self.width):
                keyed.setdefault(b.key, []).append(b)
            self.blocks[rank] = keyed
        if not self.blocks:
            raise UserError(f"no fingerprint snapshots in {', '.join(map(str, dirs))}: was it run with the "
                            "replica_divergence detector (on by default) and did it reach a step?")

    def keys(self) -> list[int]:
        return sorted(set().union(*(set(k) for k in self.blocks.values())))

    def classes(self, key: int) -> dict[int, int]:
        """rank -> the first rank whose blocks at ``key`` are the same, and whose steps there are kept in the same
        form (its pins: a step one rank's finding kept whole is a digest on a rank without one): its class's
        representative, whose steps stand for the class's."""
        seen: dict[bytes, int] = {}
        out = {}
        lo, hi = key * self.width, (key + 1) * self.width
        for rank in sorted(self.blocks):
            got = self.blocks[rank].get(key)
            if not got:
                continue
            pins = self.pins.get(rank)
            if pins is None:
                pins = self.pins[rank] = _pins(rank, self.folders[rank])
            kept = [(max(a, lo), min(b, hi - 1)) for a, b in zip(pins.lo, pins.hi, strict=True) if a < hi and b >= lo]
            sig = b"".join(json.dumps(self.lists[rank][b.nid]).encode() + b.acc.tobytes()
                           + f"{b.first},{b.last},{b.steps};".encode() for b in got) + repr(kept).encode()
            out[rank] = seen.setdefault(sig, rank)
        return out

    def may_differ(self, key: int) -> bool:
        """Whether ranks may differ in the block: the block digests compared as one step's fingerprints would be
        (by name, within replica groups); a rank with two blocks there (a names change) is looked at."""
        rows: Snapshots = {}
        for rank, keyed in self.blocks.items():
            got = keyed.get(key)
            if not got:
                continue
            if len(got) > 1:
                return True
            rows[rank] = {0: (self.lists[rank][got[0].nid], got[0].acc)}
        return bool(diff_step(rows, 0))

    def whole(self, rank: int) -> tuple[dict, dict]:
        """A representative's snapshots and thinned steps' digests, read once."""
        if rank not in self._whole:
            folder, lists = self.folders[rank], self.lists[rank]
            self._whole[rank] = (read_stream(folder, lists), read_roots(folder, lists))
        return self._whole[rank]

    def at(self, key: int) -> tuple[Snapshots, Roots, dict[int, int]]:
        """The block's steps of one rank per class, and the classes."""
        classes = self.classes(key)
        lo, hi = key * self.width, (key + 1) * self.width
        snaps: Snapshots = {}
        roots: Roots = {}
        for rep in sorted(set(classes.values())):
            s, r = self.whole(rep)
            snaps[rep] = {k: v for k, v in s.items() if lo <= k < hi}
            roots[rep] = {k: v for k, v in r.items() if lo <= k < hi}
        return snaps, roots, classes

    def expand(self, snaps: Snapshots, roots: Roots, classes: dict[int, int], step: int) -> tuple[Snapshots, Roots]:
        """One step of every rank, each from its class's representative."""
        full: Snapshots = {r: {step: snaps[rep][step]} for r, rep in classes.items() if step in snaps.get(rep, {})}
        thin: Roots = {r: {step: roots[rep][step]} for r, rep in classes.items() if step in roots.get(rep, {})}
        return full, thin

    def first(self) -> tuple[int, list[TensorDiff], Snapshots, Roots] | None:
        for key in self.keys():
            if not self.may_differ(key):
                continue
            snaps, roots, classes = self.at(key)
            found = first_divergent_step(snaps, roots)
            if found is not None:
                full, thin = self.expand(snaps, roots, classes, found[0])
                diffs = diff_step(full, found[0]) or diff_thinned(thin, found[0], full)
                return found[0], diffs, full, thin
        return None

    def step(self, step: int) -> tuple[list[TensorDiff], Snapshots, Roots] | None:
        """The ranks compared at ``step``; None when no rank checked it."""
        snaps, roots, classes = self.at(step // self.width)
        full, thin = self.expand(snaps, roots, classes, step)
        if not full and not thin:
            return None
        return diff_step(full, step) or diff_thinned(thin, step, full), full, thin

    def spans(self) -> tuple[str, str]:
        """The checked steps (first..last (the most any rank checked)) and the thinned ones (each rank's roots
        file: its first and last step and its count, three small reads)."""
        firsts = [b.first for keyed in self.blocks.values() for bs in keyed.values() for b in bs]
        lasts = [b.last for keyed in self.blocks.values() for bs in keyed.values() for b in bs]
        most = max(sum(b.steps for bs in keyed.values() for b in bs) for keyed in self.blocks.values())
        checked = f"{min(firsts)}..{max(lasts)} ({most})" if firsts else "none"
        spans = [t for folder in self.folders.values() if (t := _roots_span(folder)) is not None]
        thinned = (f"{min(a for a, _, _ in spans)}..{max(b for _, b, _ in spans)} ({max(n for _, _, n in spans)})"
                   if spans else "none")
        return checked, thinned


def _roots_span(folder: Path) -> tuple[int, int, int] | None:
    size = 24
    try:
        with open(folder / layout.FINGERPRINT_ROOTS, "rb") as f:
            first = f.read(8)
            n = f.seek(0, 2) // size
            if not n:
                return None
            f.seek((n - 1) * size)
            last = f.read(8)
    except OSError:
        return None
    return int.from_bytes(first, "little", signed=True), int.from_bytes(last, "little", signed=True), n


def _pins(rank: int, folder: Path) -> retention.Pins:
    """A rank's pins as its fingerprint writer kept them: every finding of its own, as its event stream holds
    them (through its index where it has one: its essential records and the stream past it; whole otherwise),
    read only for the blocks where ranks may differ."""
    from distdebug.artifacts.reader import load_rank

    pins = retention.Pins()
    for rec in load_rank(rank, folder).records:
        if rec.get("kind") == schema.FINDING and isinstance(rec.get("step"), int):
            pins.add(rec["step"])
    return pins


def fingerprint_bytes(dirs: list[Path]) -> int:
    return sum(p.stat().st_size for d in dirs for _, r in layout.rank_dirs(d)
               for p in layout.stream_files(r / layout.FINGERPRINTS) if p.is_file())


def scaled(dirs: list[Path]) -> Scaled | None:
    """The blocks of a large run's ranks, or None: a small run (read whole), or one without blocks of every
    rank (an older run, a restarted rank, a tail thinned away): read whole, right and slower."""
    if fingerprint_bytes(dirs) <= BLOCKS_FROM_BYTES:
        return None
    try:
        return Scaled(dirs)
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------- distdebug diff
def rank_result(run_dir: Path, step: int | None, nodes: list[Path] | None = None) -> dict[str, Any]:
    """``nodes``: the other run directories of the same job (each node wrote its own; checked to be one job)."""
    if nodes:
        from distdebug.artifacts.reader import load_runs

        load_runs([run_dir, *nodes])  # one line, and nothing compared, when they are not one job's
    big = scaled([run_dir, *(nodes or [])])
    if big is not None:
        return _scaled_result(big, run_dir, step)
    roots: Roots = {}
    snaps = load_snapshots(run_dir, roots)
    if nodes:
        for node in nodes:
            snaps.update(load_snapshots(node, roots))
    whole = steps_of(snaps)
    thinned = sorted(set().union(*(set(r) for r in roots.values())) - set(whole))
    steps = sorted(set(whole) | set(thinned))
    if step is not None:
        if step not in steps:
            raise UserError(f"step {step} was not checked in {run_dir}; checked steps: {_span(steps)}")
        diffs = diff_step(snaps, step) or diff_thinned(roots, step, snaps)
        found_step = step if diffs else None
    else:
        first = first_divergent_step(snaps, roots)
        found_step, diffs = first if first else (None, [])
    at = step if step is not None else found_step
    return {
        "mode": "ranks", "run": str(run_dir), "ranks": sorted(snaps), "checked_steps": _span(steps),
        "thinned_steps": _span(thinned), "step": at, "identical": not diffs,
        "thinned": at is not None and any(at in r for r in roots.values()),
        "not_compared": _other_names(snaps, roots, at) if at is not None else [],
        "tensors": [d.to_dict() for d in diffs],
    }


def _scaled_result(big: Scaled, run_dir: Path, step: int | None) -> dict[str, Any]:
    checked, thinned_span = big.spans()
    if step is not None:
        got = big.step(step)
        if got is None:
            raise UserError(f"step {step} was not checked in {run_dir}; checked steps: {checked}")
        diffs, full, thin = got
        found_step = step if diffs else None
    else:
        first = big.first()
        found_step, diffs, full, thin = first if first else (None, [], {}, {})
    at = step if step is not None else found_step
    return {
        "mode": "ranks", "run": str(run_dir), "ranks": sorted(big.blocks), "checked_steps": checked,
        "thinned_steps": thinned_span, "step": at, "identical": not diffs,
        "thinned": at is not None and any(at in r for r in thin.values()),
        "not_compared": _other_names(full, thin, at) if at is not None else [],
        "tensors": [d.to_dict() for d in diffs],
        "read": f"through the fingerprint blocks ({big.width} steps each): {len(big._whole)} rank(s) read whole",
    }


def runs_result(a: Path, b: Path) -> dict[str, Any]:
    ra: Roots = {}
    rb: Roots = {}
    sa, sb = load_snapshots(a, ra), load_snapshots(b, rb)
    found, compared = diff_runs(sa, sb, ra, rb)
    if compared == 0:
        raise UserError(f"{a} and {b} share no checked (rank, step): nothing to compare")
    return {
        "mode": "runs", "run_a": str(a), "run_b": str(b), "compared": compared, "identical": found is None,
        "step": found.step if found else None, "rank": found.rank if found else None,
        "tensors": [{"tensor": t} for t in (found.tensors if found else [])],
    }


def _span(steps: list[int]) -> str:
    return f"{steps[0]}..{steps[-1]} ({len(steps)})" if steps else "none"
