"""Pairwise covering arrays: few rows in which every pair of values of every
two factors appears together at least once.

Checker sweeps use them to draw each tensor's dtype, layout and flag
independently: a bug that needs two fields to take particular values (the
residual's dtype and residual_out's, say) shows in some row, at a cost that
grows with the square of the levels instead of their product.

A factor can switch others off (`off`): with no residual, residual_out's dtype
means nothing, so a row covers only the pairs of its effective factors, and a
pair that no row can make effective (no residual beside a residual_out dtype)
is not asked for.
"""
from __future__ import annotations

import itertools
import random

CANDIDATES = 30  # rows tried per added row; the best one is kept


def _effective(row: dict, off: dict) -> set:
    """The factors whose value matters in `row`."""
    dead = set()
    for (name, value), switched in off.items():
        if row.get(name, object()) == value:
            dead |= set(switched)
    return set(row) - dead


def _pairs_of(row: dict, off: dict) -> set:
    live = sorted(_effective(row, off))
    return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(live, 2)}


def required_pairs(factors: dict, off: dict) -> set:
    """Every pair of (factor, value) that some row can make effective."""
    names = sorted(factors)
    pairs = set()
    for a, b in itertools.combinations(names, 2):
        for va, vb in itertools.product(factors[a], factors[b]):
            if {a, b} <= _effective({a: va, b: vb}, off):
                pairs.add(((a, va), (b, vb)))
    return pairs


def covering_array(factors: dict, off: dict | None = None, seed: int = 0) -> list:
    """Rows ({factor: value}) covering every required pair. `factors` maps a
    name to its values (hashable); `off` maps (factor, value) to the factors
    that value makes irrelevant. Greedy (each row the best of CANDIDATES
    random completions of an uncovered pair) and deterministic for a seed."""
    off = off or {}
    names = sorted(factors)
    uncovered = required_pairs(factors, off)
    rng = random.Random(seed)
    rows = []
    while uncovered:
        seed_pair = min(uncovered, key=repr)  # progress: every new row covers this pair
        best, best_gain = None, -1
        for _ in range(CANDIDATES):
            row = dict(seed_pair)
            keep = set(row)  # factors the seed pair needs effective
            for name in rng.sample([n for n in names if n not in row], len(names) - len(row)):
                options = [v for v in factors[name] if not (keep & set(off.get((name, v), ())))]

                def gain(v):  # uncovered pairs of this value with the values chosen so far
                    return sum(((name, v), (o, row[o])) in uncovered if name < o else
                               ((o, row[o]), (name, v)) in uncovered for o in row)

                top = max(map(gain, options))
                row[name] = rng.choice([v for v in options if gain(v) == top])
            covered = _pairs_of(row, off) & uncovered
            if len(covered) > best_gain:
                best, best_gain = row, len(covered)
        rows.append(best)
        uncovered -= _pairs_of(best, off)
    return rows


def uncovered_pairs(rows: list, factors: dict, off: dict | None = None) -> set:
    """The required pairs that `rows` miss (empty for a covering array)."""
    off = off or {}
    missing = required_pairs(factors, off)
    for row in rows:
        missing -= _pairs_of(row, off)
    return missing
