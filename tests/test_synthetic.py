"""Tests of the synthetic workload generator (sae_env.sources.synthetic)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sae_env.sources import load_source
from sae_env.sources import synthetic as S
from sae_env.sources.synthetic_config import merge
from sae_env.trace import AppType, TokenType, Trace, TraceFormatError, chain_requests, token_blocks

SMALL = {  # short segments and a small block size: many blocks straddle segment boundaries
    "block_size": 4,
    "phases": [{"duration": 30.0, "rate": 1.0, "mix": {"templated": 0.3, "chat": 0.4, "agent": 0.3}}],
    "templated": {"n_templates": 4, "system_tokens": {"mean": 6, "sigma": 0.5},
                  "template_tokens": {"mean": 10, "sigma": 0.5}, "user_tokens": {"mean": 5, "sigma": 0.8},
                  "output_tokens": {"mean": 5, "sigma": 0.5}},
    "chat": {"n_system": 2, "system_tokens": {"mean": 7, "sigma": 0.5}, "turns": {"mean": 3, "max": 6},
             "user_tokens": {"mean": 3, "sigma": 0.9}, "response_tokens": {"mean": 6, "sigma": 0.8},
             "reasoning_prob": 0.5, "reasoning_tokens": {"mean": 4, "sigma": 0.8}, "gap_mu": 0.5, "gap_sigma": 0.5},
    "agent": {"n_agents": 2, "system_tokens": 9, "tools_tokens": 7, "task_tokens": {"mean": 3, "sigma": 0.5},
              "steps": {"mean": 3, "max": 6}, "call_tokens": {"mean": 3, "sigma": 0.5},
              "tool_output_tokens": {"mean": 5, "sigma": 1.0}, "user_prob": 0.3, "reasoning_prob": 0.3,
              "reasoning_tokens": 2},
}


def small(**over) -> S.SyntheticConfig:
    return S.SyntheticConfig.from_dict(merge(SMALL, over))


def same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    """a[i] == a[j] iff b[i] == b[j] for all i, j."""
    if a.shape != b.shape:
        return False
    pairs = np.unique(np.stack([a, b], axis=1), axis=0)
    return len(pairs) == len(np.unique(a)) == len(np.unique(b))


def reference(p: S.Plan) -> dict[str, np.ndarray]:
    """Materialise every token (id = (segment uid, offset)) and cut blocks with trace.token_blocks: the spec, slowly."""
    bs = p.block_size
    contents, types, n_prompt, lengths, ptok, otok = [], [], [], [], [], []
    for i in range(len(p)):
        segs = p.segs[p.seg_offsets[i]:p.seg_offsets[i + 1]]
        toks = np.concatenate([(int(s) + 1) * (1 << 24) + np.arange(p.seg_len[s]) for s in segs])
        tt = np.concatenate([np.full(p.seg_len[s], p.seg_type[s]) for s in segs])
        c, ty = token_blocks(toks, tt, bs)
        contents.append(c)
        types.append(ty)
        lengths.append(c.size)
        pt = int(p.seg_len[segs[:p.n_prompt_segs[i]]].sum())
        ptok.append(pt)
        otok.append(toks.size - pt)
        n_prompt.append(pt // bs)
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    content = np.concatenate(contents) if contents else np.zeros(0, np.uint64)
    pk, po, ok, oo = chain_requests(content, off, np.array(n_prompt, dtype=np.int64))
    allt = np.concatenate(types) if types else np.zeros(0, np.int8)
    pos = np.arange(off[-1]) - np.repeat(off[:-1], lengths)
    is_p = pos < np.repeat(n_prompt, lengths)
    return {"prompt_keys": pk, "prompt_offsets": po, "output_keys": ok, "output_offsets": oo,
            "prompt_types": allt[is_p], "output_types": allt[~is_p], "prompt_tokens": np.array(ptok),
            "output_tokens": np.array(otok)}


def check_against_reference(cfg: S.SyntheticConfig) -> Trace:
    p = S.plan(cfg)
    tr = S.trace_from_plan(p)
    ref = reference(p)
    for name in ("prompt_offsets", "output_offsets", "prompt_types", "output_types", "prompt_tokens",
                 "output_tokens"):
        np.testing.assert_array_equal(getattr(tr, name), ref[name], err_msg=name)
    # Same equality structure over all keys, prompt and output together.
    assert same_partition(np.concatenate([tr.prompt_keys, tr.output_keys]),
                          np.concatenate([ref["prompt_keys"], ref["output_keys"]]))
    return tr


# ----------------------------------------------------------------------------------------------------------------


def test_differential_against_token_reference():
    tr = check_against_reference(small(seed=3))
    assert len(tr) > 50
    # The config really exercises blocks that span several segments.
    p = S.plan(small(seed=3))
    assert (p.seg_len[p.segs] < p.block_size).mean() > 0.2


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), bs=st.sampled_from([1, 2, 3, 5, 8, 16]),
       rp=st.floats(0, 1), zipf=st.floats(0, 3), sig=st.floats(0, 1.5),
       mix=st.lists(st.floats(0, 1), min_size=3, max_size=3).filter(lambda w: sum(w) > 0.01),
       n_phases=st.integers(1, 3))
def test_random_small_configs_build_valid_traces(seed, bs, rp, zipf, sig, mix, n_phases):
    w = dict(zip(S.KINDS, mix, strict=True))
    cfg = small(seed=seed, block_size=bs,
                phases=[{"duration": 8.0, "rate": 1.5, "mix": w} for _ in range(n_phases)],
                templated={"zipf_s": zipf, "user_tokens": {"mean": 5, "sigma": sig}},
                chat={"reasoning_prob": rp}, agent={"reasoning_prob": rp})
    tr = check_against_reference(cfg)
    tr.validate()
    assert (np.diff(tr.t) >= 0).all()
    # Every full block of the sequence is a key: prompt blocks + output blocks.
    n_all = np.diff(tr.prompt_offsets) + np.diff(tr.output_offsets)
    np.testing.assert_array_equal(n_all, (tr.prompt_tokens + tr.output_tokens) // bs)
    np.testing.assert_array_equal(np.diff(tr.prompt_offsets), tr.prompt_tokens // bs)
    assert set(np.unique(tr.app)) <= {AppType.SINGLE_TURN, AppType.CHAT, AppType.AGENT}


def test_determinism():
    a = S.generate(S.make_config("tiny", seed=11))
    b = S.generate(S.make_config("tiny", seed=11))
    c = S.generate(S.make_config("tiny", seed=12))
    assert a.equals(b)
    assert not a.equals(c)
    # Segment uids depend on the seed: traces of different seeds share no key by accident.
    assert not set(a.prompt_keys.tolist()) & set(c.prompt_keys.tolist())
    ta, _ = load_source("synthetic", None, preset="tiny", seed=11)
    assert ta.equals(a)


def test_presets_and_meta():
    for name in S.PRESETS:
        cfg = S.make_config(name)
        assert cfg.block_size == 16
    tr = S.generate(S.make_config("shift", phases=[{"duration": 30, "rate": 1, "mix": {"chat": 1}}] * 3))
    assert [p["start"] for p in tr.meta["phases"]] == [0.0, 30.0, 60.0]
    shift = S.make_config("shift")
    assert [p.mix["templated"] for p in shift.phases] == [0.8, 0.1, 0.1]
    assert [p.mix["agent"] for p in shift.phases] == [0.1, 0.1, 0.8]
    tiny, rep = load_source("synthetic", None, preset="tiny")
    assert tiny.meta["source"] == "synthetic" and tiny.meta["preset"] == "tiny"
    assert rep.rows_read == len(tiny) and rep.notes
    assert json.dumps(tiny.meta)  # JSON-able
    # The defaults are the heterogeneous preset: all three kinds, chat with reasoning.
    d = S.SyntheticConfig()
    assert d == S.make_config("heterogeneous")
    assert d.chat.reasoning_prob > 0 and all(d.phases[0].mix[k] > 0 for k in S.KINDS)


def test_gap_fit_recovers_lognormal_parameters():
    cfg = S.make_config("tiny", seed=5, drain=True, phases=[{"duration": 2500, "rate": 1.0,
                                                              "mix": {"chat": 0.5, "agent": 0.5}}],
                        chat={"gap_mu": 4.88, "gap_sigma": 0.98, "turns": {"mean": 3, "max": 10}},
                        agent={"gap_mu": 1.0, "gap_sigma": 0.8})
    tr = S.generate(cfg)
    for app, mu, sigma in ((AppType.CHAT, 4.88, 0.98), (AppType.AGENT, 1.0, 0.8)):
        sel = np.flatnonzero(tr.app == app)
        o = sel[np.lexsort((tr.turn[sel], tr.session[sel]))]
        same = tr.session[o][1:] == tr.session[o][:-1]
        assert (tr.turn[o][1:][same] == tr.turn[o][:-1][same] + 1).all()
        gaps = np.diff(tr.t[o])[same]
        assert gaps.size > 1500
        lg = np.log(gaps)
        mu_hat, sigma_hat = lg.mean(), lg.std()
        assert abs(mu_hat - mu) < 0.1 * abs(mu), (app, mu_hat)
        assert abs(sigma_hat - sigma) < 0.1 * sigma, (app, sigma_hat)


def _consecutive_turns(tr: Trace, app: AppType):
    sel = np.flatnonzero(tr.app == app)
    o = sel[np.lexsort((tr.turn[sel], tr.session[sel]))]
    for a, b in zip(o[:-1], o[1:], strict=True):
        if tr.session[a] == tr.session[b]:
            yield int(a), int(b)


def test_reasoning_blocks_never_reused():
    cfg = small(seed=7, chat={"reasoning_prob": 0.6}, agent={"reasoning_prob": 0.5})
    p = S.plan(cfg)
    tr = S.trace_from_plan(p)
    prompt_keys = set(tr.prompt_keys.tolist())
    r_keys = tr.output_keys[tr.output_types == TokenType.REASONING]
    assert r_keys.size > 20
    assert not prompt_keys & set(r_keys.tolist())
    assert TokenType.REASONING not in set(tr.prompt_types.tolist())
    # Stronger: every output block of a request with reasoning covers reasoning tokens (the reasoning opens the
    # output), so none of them, straddling block included, is in any prompt.
    for i in np.flatnonzero(p.reasoning):
        ok, _ = tr.output_blocks(i)
        assert not prompt_keys & set(ok.tolist())


def test_prefix_growth_within_sessions():
    """Turn k prompt keys are a prefix of turn k+1's; with no reasoning at turn k, so are prompt + output keys."""
    cfg = small(seed=9, block_size=4, chat={"reasoning_prob": 0.4}, agent={"reasoning_prob": 0.4})
    p = S.plan(cfg)
    tr = S.trace_from_plan(p)
    n_with, n_without, straddle_non_reasoning = 0, 0, 0
    for app in (AppType.CHAT, AppType.AGENT):
        for a, b in _consecutive_turns(tr, app):
            pa, _ = tr.prompt_blocks(a)
            pb, _ = tr.prompt_blocks(b)
            oa, ta = tr.output_blocks(a)
            assert np.array_equal(pb[:pa.size], pa)
            if p.reasoning[a]:
                n_with += 1
                assert not set(oa.tolist()) & set(pb.tolist())
                if tr.prompt_tokens[a] % 4 and oa.size and ta[0] != TokenType.REASONING:
                    straddle_non_reasoning += 1  # the straddling block may be dominated by the prompt's tail
            else:
                n_without += 1
                seq = np.concatenate([pa, oa])
                assert np.array_equal(pb[:seq.size], seq)
    assert n_with > 10 and n_without > 10 and straddle_non_reasoning > 0


def test_templated_requests_share_template_head():
    cfg = small(seed=2, block_size=4, phases=[{"duration": 100, "rate": 1, "mix": {"templated": 1}}],
                templated={"n_system": 1, "system_tokens": 8, "template_tokens": {"mean": 20, "sigma": 0.5},
                           "n_templates": 5})
    p = S.plan(cfg)
    tr = S.trace_from_plan(p)
    assert (tr.app == AppType.SINGLE_TURN).all()
    heads = {}
    for i in range(len(tr)):
        pk, pt = tr.prompt_blocks(i)
        segs = p.segs[p.seg_offsets[i]:p.seg_offsets[i + 1]]
        n_head = int(p.seg_len[segs[:2]].sum()) // 4  # blocks fully inside system + template
        assert (pt[:2] == TokenType.SYSTEM).all() and (pt[2:n_head] == TokenType.TEMPLATE).all()
        heads.setdefault(int(p.template[i]), []).append(pk[:n_head])
        assert pk[n_head:].size == 0 or pt[-1] in (TokenType.USER, TokenType.TEMPLATE)
    firsts = {}
    for tpl, hs in heads.items():
        assert all(np.array_equal(h, hs[0]) for h in hs)  # same template -> same head keys
        firsts[tpl] = hs[0][2]  # first template block (system is exactly 2 blocks)
    assert len(set(firsts.values())) == len(firsts)  # different templates differ from the first template block
    sys_keys = {tuple(h[0][:2]) for h in heads.values()}
    assert len(sys_keys) == 1  # one shared system prompt


def test_zipf_popularity():
    s = 1.2
    cfg = S.make_config("tiny", seed=4, phases=[{"duration": 4000, "rate": 1, "mix": {"templated": 1}}],
                        templated={"n_templates": 20, "zipf_s": s, "system_tokens": 32})
    p = S.plan(cfg)
    tr = S.trace_from_plan(p)
    # From the trace alone: the key of the first template block (system = 2 blocks) identifies the template.
    keys = tr.prompt_keys[tr.prompt_offsets[:-1] + 2]
    _, counts = np.unique(keys, return_counts=True)
    freq = np.sort(counts)[::-1] / counts.sum()
    pmf = np.arange(1, 21) ** -s
    pmf /= pmf.sum()
    n = counts.sum()
    assert np.all(np.abs(freq[:5] - pmf[:5]) < 5 * np.sqrt(pmf[:5] * (1 - pmf[:5]) / n))
    slope = np.polyfit(np.log(np.arange(1, 9)), np.log(freq[:8]), 1)[0]
    assert abs(-slope - s) < 0.15
    # Rank order: template index i is the (i+1)-th most popular for the clearly separated top ranks.
    by_tpl = np.bincount(p.template, minlength=20)
    assert list(np.argsort(-by_tpl[:4], kind="stable")) == [0, 1, 2, 3]


def test_phase_mix_proportions():
    cfg = S.make_config("tiny", seed=8, phases=[
        {"duration": 800, "rate": 1.0, "mix": {"templated": 0.8, "chat": 0.1, "agent": 0.1}},
        {"duration": 800, "rate": 1.0, "mix": {"templated": 0.1, "chat": 0.8, "agent": 0.1}},
        {"duration": 800, "rate": 1.0, "mix": {"templated": 0.2, "chat": 0.2, "agent": 0.6}, "name": "agentic"}])
    tr = S.generate(cfg)
    assert [p["name"] for p in tr.meta["phases"]] == ["phase0", "phase1", "agentic"]
    ph = S.phase_of(tr)
    first = tr.turn == 1
    app_of = {"templated": AppType.SINGLE_TURN, "chat": AppType.CHAT, "agent": AppType.AGENT}
    for i, phase in enumerate(cfg.phases):
        sel = first & (ph == i)
        n = int(sel.sum())
        assert abs(n - 800) < 5 * np.sqrt(800)
        for kind, w in phase.mix.items():
            frac = (tr.app[sel] == app_of[kind]).mean()
            assert abs(frac - w) < 4 * np.sqrt(w * (1 - w) / n) + 1e-9, (i, kind, frac)
        # Session starts lie in their phase's window.
        assert ((tr.t[sel] >= 800 * i) & (tr.t[sel] < 800 * (i + 1))).all()
    # A session starts with its first request, exactly.
    p = S.plan(cfg)
    f = p.turn == 1
    np.testing.assert_array_equal(p.session_start[p.session[f]], p.t[f])
    np.testing.assert_array_equal(p.phase, p.session_phase[p.session])
    # by="time" differs for turns arriving after their session's phase ended; sessions may run on past the end.
    pt = S.phase_of(tr, by="time")
    assert ((pt >= ph) | (pt == -1)).all()
    assert (pt != ph).any()
    assert tr.t[-1] > 2400 and (pt[tr.t >= 2400] == -1).all()


def test_drain_false_drops_late_requests():
    cfg = S.make_config("tiny", seed=1, chat={"gap_mu": 3.0})
    full = S.generate(cfg)
    cut = S.generate(S.make_config("tiny", seed=1, chat={"gap_mu": 3.0}, drain=False))
    assert full.t[-1] > 60 and cut.t[-1] < 60
    assert len(cut) == int((full.t < 60).sum())


def test_config_validation_messages():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['reasoning_p'\].*valid keys.*reasoning_prob"):
        S.make_config(chat={"reasoning_p": 0.2})
    with pytest.raises(ValueError, match=r"chat.*reasoning_prob must lie in \[0, 1\], got 1.5"):
        S.make_config(chat={"reasoning_prob": 1.5})
    with pytest.raises(ValueError, match=r"phases\[1\].*unknown key 'chatt'.*valid keys"):
        S.make_config(phases=[{"duration": 1, "rate": 1}, {"duration": 1, "rate": 1, "mix": {"chatt": 1}}])
    with pytest.raises(ValueError, match=r"phases\[0\].*duration must be > 0"):
        S.make_config(phases=[{"duration": 0, "rate": 1}])
    with pytest.raises(ValueError, match=r"phases\[0\].*missing required key"):
        S.make_config(phases=[{"rate": 1}])
    with pytest.raises(ValueError, match=r"templated.user_tokens.*mean must be >= 1"):
        S.make_config(templated={"user_tokens": {"mean": 0}})
    with pytest.raises(ValueError, match=r"block_size must lie in"):
        S.make_config(block_size=0)
    with pytest.raises(ValueError, match=r"n_templates must be an integer"):
        S.make_config(templated={"n_templates": 2.5})
    with pytest.raises(ValueError, match=r"dist must be one of"):
        S.make_config(chat={"turns": {"mean": 3, "dist": "poisson"}})
    with pytest.raises(ValueError, match=r"gap_sigma must lie in"):
        S.make_config(agent={"gap_sigma": 0})
    with pytest.raises(ValueError, match=r"more than the limit"):
        S.make_config(phases=[{"duration": 1e9, "rate": 10}])
    with pytest.raises(ValueError, match=r"unknown synthetic preset 'huge'.*tiny"):
        load_source("synthetic", None, preset="huge")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['blocksize'\]"):
        load_source("synthetic", None, blocksize=16)
    with pytest.raises(ValueError, match=r"on_error"):
        load_source("synthetic", None, on_error="ignore")


def test_load_from_yaml_and_json_files(tmp_path):
    y = tmp_path / "w.yaml"
    y.write_text("preset: tiny\nseed: 3\nchat:\n  reasoning_prob: 0.0\n")
    tr, rep = load_source("synthetic", y)
    assert tr.equals(S.generate(S.make_config("tiny", seed=3, chat={"reasoning_prob": 0.0})))
    assert rep.path == str(y)
    # Options override the file; nested mappings merge.
    tr2, _ = load_source("synthetic", y, seed=4, chat={"gap_mu": 2.0})
    assert tr2.equals(S.generate(S.make_config("tiny", seed=4, chat={"reasoning_prob": 0.0, "gap_mu": 2.0})))
    j = tmp_path / "w.json"
    j.write_text(json.dumps({"preset": "tiny", "seed": 3, "chat": {"reasoning_prob": 0.0}}))
    assert load_source("synthetic", j)[0].equals(tr)
    bad = tmp_path / "bad.yaml"
    bad.write_text("seed: 1\nchat: [1, 2\n")
    with pytest.raises(TraceFormatError, match=r"bad.yaml.*line \d"):
        load_source("synthetic", bad)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("sed: 1\n")
    with pytest.raises(ValueError, match=r"wrong.yaml.*'sed'.*valid options"):
        load_source("synthetic", wrong)
    nested = tmp_path / "nested.yaml"
    nested.write_text("agent:\n  steps: {mean: 2, maxx: 3}\n")
    with pytest.raises(ValueError, match=r"nested.yaml.agent.steps: unknown key\(s\) \['maxx'\]"):
        load_source("synthetic", nested)
    with pytest.raises(ValueError, match=r"\.yaml, \.yml or \.json"):
        load_source("synthetic", tmp_path / "x.toml")


def test_app_types_and_token_types():
    tr = S.generate(S.make_config("tiny", seed=6))
    for i in range(len(tr)):
        r = tr.request(i)
        assert r.prompt_types[0] == TokenType.SYSTEM
        if r.app == AppType.AGENT and r.prompt_keys.size > 20:
            assert TokenType.TEMPLATE in r.prompt_types
        if r.app == AppType.AGENT and r.turn > 1:
            assert TokenType.TOOL_OUTPUT in r.prompt_types or TokenType.USER in r.prompt_types
        if r.app == AppType.CHAT and r.turn > 1:
            assert TokenType.ASSISTANT in r.prompt_types
    assert (tr.turn[tr.app == AppType.SINGLE_TURN] == 1).all()
    # Pools: chat system prompts (3 in "tiny") and agent definitions (2) are each drawn by many sessions.
    big = S.generate(S.make_config("tiny", seed=6, phases=[{"duration": 200, "rate": 1,
                                                              "mix": {"chat": 0.5, "agent": 0.5}}]))
    first_key = big.prompt_keys[big.prompt_offsets[:-1]]
    for app, n_pool in ((AppType.CHAT, 3), (AppType.AGENT, 2)):
        sel = (big.app == app) & (big.turn == 1)
        _, counts = np.unique(first_key[sel], return_counts=True)
        assert counts.size == n_pool and counts.min() > 0.5 * sel.sum() / n_pool
    # Session ids: numbered by start, turn 1 first.
    first = tr.turn == 1
    assert np.array_equal(np.sort(tr.session[first]), np.arange(first.sum()))


def test_fixed_lengths_give_exact_token_counts():
    cfg = S.make_config("tiny", seed=0, phases=[{"duration": 20, "rate": 1, "mix": {"templated": 1}}],
                        templated={"system_tokens": 17, "template_tokens": 40, "user_tokens": 9,
                                   "output_tokens": 5})
    tr = S.generate(cfg)
    assert (tr.prompt_tokens == 66).all() and (tr.output_tokens == 5).all()
    assert (np.diff(tr.prompt_offsets) == 4).all()  # 66 // 16
    assert (np.diff(tr.output_offsets) == 0).all()  # 71 // 16 = 4: no output block completes


def test_generation_speed_small():
    cfg = S.make_config("heterogeneous", phases=[{"duration": 120, "rate": 1.0,
                                                  "mix": {"templated": 0.4, "chat": 0.35, "agent": 0.25}}])
    t0 = time.perf_counter()
    tr = S.generate(cfg)
    dt = time.perf_counter() - t0
    blocks = tr.n_blocks + tr.n_output_blocks
    assert blocks > 50_000
    assert blocks / dt > 100_000  # measured ~2 M blocks/s on 2 cores


@pytest.mark.slow
def test_generation_speed_million_blocks():
    cfg = S.make_config("heterogeneous", phases=[{"duration": 900, "rate": 1.0,
                                                  "mix": {"templated": 0.4, "chat": 0.35, "agent": 0.25}}])
    t0 = time.perf_counter()
    tr = S.generate(cfg)
    dt = time.perf_counter() - t0
    blocks = tr.n_blocks + tr.n_output_blocks
    assert blocks > 1_000_000
    assert dt < 10.0, f"{blocks} blocks in {dt:.1f} s"
