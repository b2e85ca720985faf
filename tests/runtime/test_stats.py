"""Latency percentiles of the aggregate Stats."""

import re

import numpy as np
import pytest

from specdec.runtime.stats import PHASES, Stats, percentiles


@pytest.mark.parametrize(
    "values",
    [
        [1.0],
        [3.0, 1.0],
        list(range(10)),
        [0.5, 0.1, 0.9, 0.3, 0.3, 7.0, 2.5],
        list(np.random.default_rng(0).exponential(size=101)),
        list(np.random.default_rng(1).normal(size=37)),
    ],
)
def test_percentiles_match_numpy(values):
    got = percentiles(values)
    assert list(got) == ["p50", "p95", "p99"]
    for q in (50, 95, 99):
        assert got[f"p{q}"] == pytest.approx(np.percentile(values, q), rel=1e-12, abs=1e-12)
    assert percentiles(values, qs=(0, 100)) == {"p0": min(values), "p100": max(values)}


def test_percentiles_of_nothing():
    assert percentiles([]) == {}


def test_aggregate_latency_percentiles():
    per_request = []
    for i in range(20):
        s = Stats(generated_tokens=1 if i == 0 else 10)
        s.finish(arrival=0.0, first_token=0.1 * i, end=0.1 * i + 0.9 * (i != 0) + 0.05 * i)
        per_request.append(s)
    agg = Stats.aggregate(per_request, dict.fromkeys(PHASES, 0.0), 5.0)
    ttft = [s.ttft_s for s in per_request]
    tpot = [s.tpot_s for s in per_request[1:]]  # one-token requests have no TPOT
    e2e = [s.elapsed_s for s in per_request]
    for key, values in (("ttft_s", ttft), ("tpot_s", tpot), ("e2e_s", e2e)):
        assert agg.latency[key] == pytest.approx(
            {f"p{q}": np.percentile(values, q) for q in (50, 95, 99)}
        )
    assert agg.to_dict()["latency"]["e2e_s"]["p99"] == pytest.approx(np.percentile(e2e, 99))
    assert re.search(r"TTFT percentiles +P50 [\d.]+  P95 [\d.]+  P99 [\d.]+ ms", agg.summary())
