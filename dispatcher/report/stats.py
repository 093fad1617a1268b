"""The statistics of a report: pass@k (the unbiased estimator), bootstrap intervals over instances, the paired
difference of two runs on their shared instances, and McNemar's exact test.

Instances are the unit of resampling: attempts of one instance are not independent of each other.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from pydantic import BaseModel

BOOTSTRAP_SAMPLES = 5000
LEVEL = 0.95


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k attempts drawn from n, c of them correct, is correct) = 1 - C(n-c, k) / C(n, k)
    (Chen et al., 2021, "Evaluating Large Language Models Trained on Code")."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


class Interval(BaseModel):
    value: float
    lo: float
    hi: float
    level: float = LEVEL
    n: int  # instances it is over


def bootstrap_mean(values: Sequence[float], samples: int = BOOTSTRAP_SAMPLES, seed: int = 0,
                   level: float = LEVEL) -> Interval:
    """The mean of per-instance values with a percentile bootstrap interval (instances resampled)."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        raise ValueError("no values to bootstrap")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(samples, x.size))].mean(axis=1)
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(means, [tail, 100 - tail])
    return Interval(value=float(x.mean()), lo=float(lo), hi=float(hi), level=level, n=int(x.size))


class PassAtK(BaseModel):
    k: int
    estimate: Interval


def pass_at_ks(outcomes: Mapping[str, tuple[int, int]], seed: int = 0) -> list[PassAtK]:
    """pass@k for k = 1 .. the most attempts any instance has: the mean over the instances with at least k scored
    attempts, with its bootstrap interval. `outcomes`: instance -> (scored attempts n, resolved c)."""
    out = []
    top = max((n for n, _ in outcomes.values()), default=0)
    for k in range(1, top + 1):
        values = [pass_at_k(n, c, k) for n, c in outcomes.values() if n >= k]
        out.append(PassAtK(k=k, estimate=bootstrap_mean(values, seed=seed)))
    return out


class McNemar(BaseModel):
    """Exact McNemar test over paired binary outcomes: only the discordant pairs carry information."""

    a_only: int  # pairs resolved by A, not by B
    b_only: int
    both: int
    neither: int
    p_value: float


def mcnemar_exact(pairs: Sequence[tuple[bool, bool]]) -> McNemar:
    """Two-sided exact binomial test of a_only against b_only (p = 1 when there is no discordant pair)."""
    a_only = sum(1 for a, b in pairs if a and not b)
    b_only = sum(1 for a, b in pairs if b and not a)
    both = sum(1 for a, b in pairs if a and b)
    neither = len(pairs) - a_only - b_only - both
    n = a_only + b_only
    if n == 0:
        p = 1.0
    else:
        tail = sum(math.comb(n, i) for i in range(min(a_only, b_only) + 1))
        p = min(1.0, 2 * tail / 2 ** n)
    return McNemar(a_only=a_only, b_only=b_only, both=both, neither=neither, p_value=p)


class PairedDifference(BaseModel):
    """A's resolve rate minus B's on the instances both scored (per instance: resolved / scored attempts)."""

    instances: int
    a_rate: float
    b_rate: float
    difference: Interval
    mcnemar: McNemar  # on each shared instance's first scored attempt in both runs


def paired_difference(a: Mapping[str, tuple[int, int]], b: Mapping[str, tuple[int, int]],
                      first_a: Mapping[str, bool], first_b: Mapping[str, bool], seed: int = 0) -> PairedDifference:
    """`a`, `b`: instance -> (scored attempts, resolved); `first_*`: instance -> its first scored attempt resolved."""
    shared = sorted(i for i in set(a) & set(b) if a[i][0] and b[i][0])
    if not shared:
        raise ValueError("the two runs share no instance with a scored attempt")
    ra = [a[i][1] / a[i][0] for i in shared]
    rb = [b[i][1] / b[i][0] for i in shared]
    diff = bootstrap_mean([x - y for x, y in zip(ra, rb)], seed=seed)
    pairs = [(first_a[i], first_b[i]) for i in shared if i in first_a and i in first_b]
    return PairedDifference(instances=len(shared), a_rate=float(np.mean(ra)), b_rate=float(np.mean(rb)),
                            difference=diff, mcnemar=mcnemar_exact(pairs))
