"""Characterisation on the real embedded traces and on synthetic workloads: the facts the workload study must show."""

import pytest

from sae_env import data
from sae_env.characterize import characterize
from sae_env.sources import load_source


@pytest.fixture(scope="module")
def taubench():
    trace, _ = load_source("taubench", data.TAUBENCH, tools=str(data.TAUBENCH_TOOLS))
    return characterize(trace)


def test_taubench_shared_prefix_is_reused_far_more_than_user_blocks(taubench):
    by_type = taubench["by_token_type"]
    for shared in ("SYSTEM", "TEMPLATE"):
        # every call of every session re-reads the ~4.5 k-token policy + tool schemas
        assert by_type[shared]["reuse_ratio"] > 0.999
        assert by_type[shared]["reuses_per_block"] > 100 * by_type["USER"]["reuses_per_block"]
    assert by_type["USER"]["reuse_ratio"] < by_type["SYSTEM"]["reuse_ratio"]
    assert taubench["requests"] == 2454 and taubench["sessions"] == 200
    # most reuse is the shared prefix, across sessions
    assert taubench["cross_session_fraction"] > 0.6


def test_reasoning_blocks_are_reused_least():
    trace, _ = load_source("synthetic", None, preset="heterogeneous")
    by_type = characterize(trace)["by_token_type"]
    assert by_type["REASONING"]["block_refs"] > 1000
    assert by_type["REASONING"]["reuse_ratio"] == min(v["reuse_ratio"] for v in by_type.values())
    assert by_type["REASONING"]["reuse_ratio"] < 0.01


@pytest.mark.parametrize("app, mu, sigma", [("CHAT", 4.2, 0.9), ("AGENT", 1.3, 0.6)])
def test_gap_fits_recover_the_generators_lognormal(app, mu, sigma):
    trace, _ = load_source("synthetic", None, phases=[{"duration": 900, "rate": 2.0,
                                                       "mix": {"chat": 0.5, "agent": 0.5}}],
                           chat={"gap_mu": 4.2, "gap_sigma": 0.9}, agent={"gap_mu": 1.3, "gap_sigma": 0.6}, seed=7)
    fit = characterize(trace)["gaps"][app]
    assert fit["n"] > 1000
    assert fit["lognormal_mu"] == pytest.approx(mu, rel=0.10)
    assert fit["lognormal_sigma"] == pytest.approx(sigma, rel=0.10)
    assert fit["better"] == "lognormal"
    assert fit["ks_lognormal"] < fit["ks_exponential"]
