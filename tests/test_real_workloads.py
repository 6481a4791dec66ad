"""Tests of the real heterogeneous workloads (sae_env/data/workloads: recorded sessions mixed on Azure's arrival
process): Azure stretches as session starts, recorded sessions kept exactly, determinism per seed, the headroom
study, and the experiment runner reseeding them."""

from __future__ import annotations

import numpy as np
import pytest
from test_mix import check_mix

from sae_env import data
from sae_env.characterize import headroom
from sae_env.experiment import WorkloadSpec
from sae_env.sources import load_source, open_trace
from sae_env.sources import mix as M
from sae_env.sources.azure import load_process
from sae_env.trace import AppType

WORKLOADS = ("real_chat", "real_agent", "real_templated", "real_shift")


@pytest.fixture(scope="module")
def conv():
    return load_process(data.AZURE_CONV)


@pytest.fixture(scope="module")
def components():
    """The three recorded components, loaded on their own with the options the workload files give them."""
    return [load_source("conversations", None, block_size=16)[0], load_source("taubench", None, block_size=16)[0],
            load_source("gsm8k", None, block_size=16)[0]]


@pytest.fixture(scope="module")
def shift():
    return {seed: open_trace("real_shift", options={"seed": seed})[0] for seed in (0, 1)}


def brute_window(proc, start: float, duration: float, rate: float) -> np.ndarray:
    """The tiled, rate-scaled process by hand: enough copies laid end to end, then filtered."""
    k = ((proc.t.size - 1) / rate) / proc.t[-1]
    t = proc.t * k
    period = t[-1] + t[-1] / (t.size - 1)
    copies = np.concatenate([t + j * period for j in range(int((start + duration) // period) + 2)])
    return copies[(copies >= start) & (copies < start + duration)] - start


@pytest.mark.parametrize("start, duration, rate", [(0.0, 600.0, 0.1), (1234.5, 1800.0, 0.24),
                                                    (3e5, 900.0, 0.088), (0.0, 5e5, 0.5)])
def test_window_times_is_a_stretch_of_the_tiled_process(conv, start, duration, rate):
    got = conv.window_times(start, duration, rate)
    np.testing.assert_allclose(got, brute_window(conv, start, duration, rate), rtol=0, atol=1e-6)
    assert (np.diff(got) >= 0).all() and (got >= 0).all() and (got < duration).all()
    if duration > conv.period(rate):  # over whole copies, the mean rate is the asked one
        assert abs(got.size / duration - rate) < 0.05 * rate
    with pytest.raises(ValueError, match="duration"):
        conv.window_times(0.0, -1.0)


def test_azure_arrivals_take_stretches_of_the_real_gaps(conv):
    rng = np.random.default_rng(7)
    starts, phase = M.azure_arrivals(rng, conv, [600.0, 600.0, 50.0], [0.2, 0.0, 1.0])
    assert (np.diff(starts) >= 0).all() and set(phase.tolist()) <= {0, 2}
    rng = np.random.default_rng(7)
    offset = rng.uniform(0.0, conv.period(0.2))
    np.testing.assert_array_equal(starts[phase == 0], conv.window_times(offset, 600.0, 0.2))
    # Phase 2's stretch, scaled back to the trace's own clock, is a run of consecutive real inter-arrival gaps.
    k = conv.rate / 1.0
    gaps = np.diff(starts[phase == 2]) / k
    real = np.diff(conv.t)
    i = int(np.argmin(np.abs(real - gaps[0])))
    np.testing.assert_allclose(gaps[:5], real[i:i + 5], atol=1e-6)


@pytest.mark.parametrize("name", WORKLOADS)
def test_embedded_workloads_load(name):
    trace, report = open_trace(name)
    assert trace.meta["source"] == "mix" and trace.meta["components"] == ["chat", "agent", "templated"]
    assert trace.meta["config"]["arrivals"] == {"process": "azure", "trace": "azure_conv", "path": None}
    assert any("stretches of the Azure arrival process" in n for n in report.notes)
    assert report.rows_rejected == 0 and trace.block_size == 16
    assert set(np.unique(trace.app).tolist()) == {AppType.SINGLE_TURN, AppType.CHAT, AppType.AGENT}
    heavy = {"real_chat": 0, "real_agent": 1, "real_templated": 2}
    comp, phase = M.component_of(trace), M.phase_of(trace)
    for i, p in enumerate(trace.meta["phases"]):
        kind = heavy.get(name, i)  # real_shift: chat-, agent-, then templated-heavy
        share = np.bincount(comp[phase == i], minlength=3) / (phase == i).sum()
        assert share.argmax() == kind and share[kind] > 0.5, (p["name"], share)


def check_recorded(mixed, comps) -> None:
    """Every session of the mix is its recorded session, cut only where the schedule ends: request k of a mixed
    session is request k of the recorded one (turn, app, token counts, token types, key equalities within each
    component and pass, none across), at the same offset from the session's start (test_mix.check_mix); a session
    ends early only when its next recorded request would arrive after the schedule."""
    check_mix(mixed, comps, group_by_pass=True, complete=False)
    sc, so = np.asarray(mixed.meta["session_component"]), np.asarray(mixed.meta["session_origin"])
    end = mixed.meta["phases"][-1]["end"]
    sessions, first, count = np.unique(mixed.session, return_index=True, return_counts=True)
    for s, i, k in zip(sessions.tolist(), first.tolist(), count.tolist(), strict=True):
        tr = comps[sc[s]]
        rows = np.flatnonzero(tr.session_ids() == so[s])
        if k < rows.size:  # cut: its next turn would come after the schedule's end
            assert mixed.t[i] + tr.t[rows[k]] - tr.t[rows[0]] >= end - 1e-6, s


def test_recorded_sessions_keep_their_tokens_types_and_gaps(shift, components):
    for trace in shift.values():
        check_recorded(trace, components)
        trace.validate()
        assert trace.t[-1] < trace.meta["phases"][-1]["end"]
        assert sum(trace.meta["stats"]["dropped_after_schedule"].values()) > 0


def test_after_schedule_drop_is_keep_cut_at_the_end(shift):
    kept = open_trace("real_shift", options={"seed": 1, "after_schedule": "keep"})[0]
    end = kept.meta["phases"][-1]["end"]
    assert kept.t[-1] > end
    assert shift[1].equals(kept.take(np.flatnonzero(kept.t < end)))
    with pytest.raises(ValueError, match=r"after_schedule must be one of \['keep', 'drop'\]"):
        open_trace("real_shift", options={"after_schedule": "trim"})


def test_a_real_mix_is_deterministic_per_seed(shift):
    again = open_trace("real_shift", options={"seed": 1})[0]
    assert again.equals(shift[1])
    a, b = shift[0], shift[1]
    assert not np.array_equal(a.t[:50], b.t[:50])
    # Seeds move session starts and the interleaving; the recorded content stays: the same sessions start the run.
    first = lambda tr: tr.meta["session_origin"][:3]  # noqa: E731
    assert first(a) != first(b) or a.meta["session_component"][:3] != b.meta["session_component"][:3]


def test_user_files_and_poisson_default(tmp_path, conv):
    """A workload file over the user's own files: relative paths against the file, an Azure CSV of one's own."""
    import gzip
    import shutil

    with gzip.open(data.AZURE_CODE) as src, open(tmp_path / "arrivals.csv", "wb") as dst:
        shutil.copyfileobj(src, dst)
    shutil.copy(data.GSM8K, tmp_path / "problems.jsonl.gz")
    (tmp_path / "mine.yaml").write_text(
        "arrivals: {process: azure, path: arrivals.csv}\n"
        "components:\n  - {name: t, source: gsm8k, path: problems.jsonl.gz, options: {max_problems: 50}}\n"
        "phases:\n  - {duration: 300, rate: 0.2, weights: {t: 1}}\n")
    mine, report = load_source("mix", tmp_path / "mine.yaml")
    assert any("arrivals.csv" in n for n in report.notes) and len(mine) > 0
    with pytest.raises(ValueError, match="give trace .* or path"):
        M.MixArrivals("azure", trace="azure_conv", path="x.csv")
    with pytest.raises(ValueError, match="embedded Azure trace"):
        M.MixArrivals("azure", trace="wildchat")
    with pytest.raises(ValueError, match=r"arrivals: process must be one of \['poisson', 'azure'\]"):
        M.MixConfig.from_dict({"arrivals": "hawkes", "components": [{"name": "t", "source": "gsm8k"}],
                               "phases": [{"duration": 1, "rate": 1, "weights": {"t": 1}}]})
    with pytest.raises(ValueError, match="need the Azure arrival process"):
        M.interleave([mine], M.MixConfig.from_dict({"arrivals": "azure", "components": [{"name": "t",
                                                    "source": "trace"}], "phases": [{"duration": 1, "rate": 1,
                                                                                     "weights": {"t": 1}}]}))
    assert M.MixConfig.from_dict({"components": [{"name": "t", "source": "gsm8k"}],
                                  "phases": [{"duration": 1, "rate": 1, "weights": {"t": 1}}]}).arrivals.process \
        == "poisson"


def test_experiments_reseed_embedded_workloads():
    spec = WorkloadSpec.from_config({"name": "shift", "trace": "real_shift"}, "workloads[0]")
    assert spec.reseed and spec.spec_for(3) == {"trace": "real_shift", "seed": 3}
    fixed = WorkloadSpec.from_config({"trace": {"trace": "real_shift", "seed": 0}}, "workloads[0]")
    assert not fixed.reseed
    assert not WorkloadSpec.from_config("taubench", "workloads[0]").reseed


def test_headroom_is_lru_against_belady(capsys):
    from sae_env.cli import main

    trace, _ = load_source("synthetic", None, preset="tiny")
    rows = headroom(trace, (0.05, 0.2))
    for r in rows:
        assert 0 <= r["lru_token_hit_rate"] <= r["belady_token_hit_rate"] <= 1
        assert r["headroom_pp"] == pytest.approx(100 * (r["belady_token_hit_rate"] - r["lru_token_hit_rate"]))
    assert rows[0]["capacity_blocks"] < rows[1]["capacity_blocks"]
    # The replay command, another path through the same engines, gives the same hit rates.
    assert main(["replay", "--trace", "synthetic", "--opt", "preset=tiny", "--policy", "lru,belady",
                 "--capacity", "0.05", "--window", "100000"]) == 0
    out = capsys.readouterr().out.splitlines()
    lru = next(line for line in out if line.startswith("lru ")).split()
    belady = next(line for line in out if line.startswith("belady ")).split()
    assert float(lru[1]) == pytest.approx(rows[0]["lru_token_hit_rate"], abs=1e-4)
    assert float(belady[1]) == pytest.approx(rows[0]["belady_token_hit_rate"], abs=1e-4)
    assert main(["characterize", "synthetic", "--opt", "preset=tiny", "--headroom", "5%,0.2"]) == 0
    assert "headroom (pp)" in capsys.readouterr().out
    assert main(["characterize", "synthetic", "--headroom", "0"]) == 2
