"""Tests of the mix source (sae_env.sources.mix): interleaving sessions of several sources on one timeline."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sae_env import data as D
from sae_env.sources import load_source
from sae_env.sources import mix as M
from sae_env.sources import synthetic as S
from sae_env.trace import AppType, Trace, TraceBuilder, chain_requests


def same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    """a[i] == a[j] iff b[i] == b[j] for all i, j."""
    if a.shape != b.shape:
        return False
    if a.size == 0:
        return True
    ua, ia = np.unique(a, return_inverse=True)
    ub, ib = np.unique(b, return_inverse=True)
    return len(ua) == len(ub) == np.unique(ia.astype(np.int64) * len(ub) + ib).size


def synth(seed: int, mix: dict, duration: float = 60.0, rate: float = 0.5, block_size: int = 16) -> Trace:
    return S.generate(S.make_config("tiny", seed=seed, block_size=block_size,
                                    phases=[{"duration": duration, "rate": rate, "mix": mix}]))


def unknown_sessions_trace(n: int = 30, seed: int = 0, block_size: int = 16) -> Trace:
    """Requests with session -1 sharing a few prompt heads (a hand-made, Mooncake-like trace)."""
    rng = np.random.default_rng(seed)
    b = TraceBuilder(block_size=block_size, meta={"source": "test"})
    heads = [rng.integers(1, 1 << 40, size=4) for _ in range(3)]
    contents, nprompt, rows = [], [], []
    for i in range(n):
        pc = np.concatenate([heads[i % 3], rng.integers(1, 1 << 40, size=int(rng.integers(0, 4)))])
        oc = rng.integers(1, 1 << 40, size=int(rng.integers(0, 2)))
        contents.append(np.concatenate([pc, oc]))
        nprompt.append(pc.size)
        rows.append((float(i) * 0.7, pc.size, oc.size))
    off = np.concatenate([[0], np.cumsum([c.size for c in contents])])
    pk, po, ok, oo = chain_requests(np.concatenate(contents), off, np.array(nprompt))
    for i, (t, npk, nok) in enumerate(rows):
        b.add(t=t, session=-1, turn=1, app=AppType.UNKNOWN, prompt_tokens=npk * block_size + 3,
              output_tokens=nok * block_size + 1, prompt_keys=pk[po[i]:po[i + 1]], prompt_types=np.zeros(npk),
              output_keys=ok[oo[i]:oo[i + 1]], output_types=np.full(nok, 3))
    return b.build()


def config(names, phases, **kw) -> M.MixConfig:
    comps = [M.Component(name=n, source="trace") for n in names]
    return M.MixConfig(components=comps, phases=[M.MixPhase(**p) for p in phases], **kw)


def origins(mixed: Trace, comps: list[Trace], complete: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Component and original request index of every mixed request (from meta, by a plain Python walk); with
    ``complete``, every session must be whole (else each is a leading part of its recorded session)."""
    sc = np.asarray(mixed.meta["session_component"])
    so = np.asarray(mixed.meta["session_origin"])
    by_session = []
    for tr in comps:
        d: dict[int, list[int]] = {}
        for i, s in enumerate(tr.session_ids()):
            d.setdefault(int(s), []).append(i)
        by_session.append(d)
    seen: dict[int, int] = {}
    out = np.empty(len(mixed), dtype=np.int64)
    for i in range(len(mixed)):
        s = int(mixed.session[i])
        k = seen.get(s, 0)
        out[i] = by_session[sc[s]][int(so[s])][k]
        seen[s] = k + 1
    for s, k in seen.items():  # every session is complete
        assert k == len(by_session[sc[s]][int(so[s])]) or not complete
    return sc[mixed.session], out


def all_blocks(tr: Trace, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Prompt keys of the requests ``idx`` (in that order), then their output keys; and the types alike."""
    out = []
    for kind in ("prompt", "output"):
        off = getattr(tr, f"{kind}_offsets")
        n = off[idx + 1] - off[idx]
        flat = np.repeat(off[idx] - np.concatenate([[0], np.cumsum(n)[:-1]]), n) + np.arange(n.sum())
        out.append((getattr(tr, f"{kind}_keys")[flat], getattr(tr, f"{kind}_types")[flat]))
    return np.concatenate([out[0][0], out[1][0]]), np.concatenate([out[0][1], out[1][1]])


def check_mix(mixed: Trace, comps: list[Trace], group_by_pass: bool, complete: bool = True) -> None:
    comp, orig = origins(mixed, comps, complete)
    np.testing.assert_array_equal(comp, M.component_of(mixed))
    passes = np.asarray(mixed.meta["session_pass"])[mixed.session]
    first_t = {}
    for i in range(len(mixed)):
        first_t.setdefault(int(mixed.session[i]), mixed.t[i])
    keysets = []
    for c, tr in enumerate(comps):
        sel = np.flatnonzero(comp == c)
        o = orig[sel]
        for name in ("turn", "app", "prompt_tokens", "output_tokens"):
            np.testing.assert_array_equal(getattr(mixed, name)[sel], getattr(tr, name)[o])
        # Intra-session gaps: offsets from the session's first arrival are kept.
        sid = tr.session_ids()
        u, inv = np.unique(sid, return_inverse=True)
        t0 = np.full(u.size, np.inf)
        np.minimum.at(t0, inv, tr.t)
        rel_orig = tr.t[o] - t0[inv[o]]
        rel_mix = mixed.t[sel] - np.array([first_t[int(s)] for s in mixed.session[sel]])
        np.testing.assert_allclose(rel_mix, rel_orig, atol=1e-9)
        # Equality structure: per group (component, or component and pass), mixed keys <-> original keys.
        groups = np.unique(passes[sel]) if group_by_pass else [None]
        mk_all = []
        for g in groups:
            gs = sel if g is None else sel[passes[sel] == g]
            mk, mt = all_blocks(mixed, gs)
            ok, ot = all_blocks(tr, orig[gs])
            assert same_partition(mk, ok)
            np.testing.assert_array_equal(mt, ot)
            mk_all.append(mk)
        if mk_all:
            keysets.append(set(np.concatenate(mk_all).tolist()))
    # No key shared between components.
    for a in range(len(keysets)):
        for b in range(a + 1, len(keysets)):
            assert not keysets[a] & keysets[b]


# ----------------------------------------------------------------------------------------------------------------


def test_interleave_preserves_structure_and_gaps():
    chat = synth(1, {"chat": 1})
    tmpl = synth(2, {"templated": 1})
    anon = unknown_sessions_trace()
    cfg = config(["chat", "tmpl", "anon"],
                 [{"duration": 60, "rate": 1.0, "weights": {"chat": 0.5, "tmpl": 0.3, "anon": 0.2}},
                  {"duration": 60, "rate": 1.0, "weights": {"chat": 0.1, "tmpl": 0.2, "anon": 0.7}}],
                 seed=3, on_exhausted="repeat")
    mixed, stats = M.interleave([chat, tmpl, anon], cfg)
    mixed.validate()
    assert stats["passes"]["anon"] >= 2  # repeat: the same keys come back, still one equality structure
    check_mix(mixed, [chat, tmpl, anon], group_by_pass=False)
    # Unknown sessions: each request is its own session.
    anon_sessions = np.flatnonzero(np.asarray(mixed.meta["session_component"]) == 2)
    assert np.isin(mixed.session[M.component_of(mixed) == 2], anon_sessions).all()
    assert np.bincount(mixed.session)[anon_sessions].max() == 1
    # Sessions renumbered in start order, unique across components.
    first = np.unique(mixed.session, return_index=True)[1]
    assert (np.diff(mixed.t[first]) >= 0).all()
    assert mixed.session.min() == 0 and mixed.session.max() == len(mixed.meta["session_component"]) - 1
    assert json.dumps(mixed.meta)


def test_cycle_salts_each_pass():
    chat = synth(1, {"chat": 1}, duration=20)
    cfg = config(["chat"], [{"duration": 100, "rate": 1.0, "weights": {"chat": 1}}], seed=0)
    mixed, stats = M.interleave([chat], cfg)
    assert stats["passes"]["chat"] >= 3
    check_mix(mixed, [chat], group_by_pass=True)
    passes = np.asarray(mixed.meta["session_pass"])[mixed.session]
    k0 = set(mixed.prompt_keys[np.repeat(passes == 0, np.diff(mixed.prompt_offsets))].tolist())
    k1 = set(mixed.prompt_keys[np.repeat(passes == 1, np.diff(mixed.prompt_offsets))].tolist())
    assert k0 and k1 and not k0 & k1
    # Within a pass the component's own sharing survives (the chat system prompts are reused across sessions).
    first_keys = mixed.prompt_keys[mixed.prompt_offsets[:-1]][(passes == 0) & (mixed.turn == 1)]
    assert np.unique(first_keys).size < first_keys.size


def test_stop_when_exhausted():
    chat = synth(1, {"chat": 1}, duration=20)
    n_avail = int(np.unique(chat.session).size)
    cfg = config(["chat"], [{"duration": 100, "rate": 1.0, "weights": {"chat": 1}}], seed=0, on_exhausted="stop")
    mixed, stats = M.interleave([chat], cfg)
    assert stats["sessions_used"]["chat"] == n_avail and stats["dropped_exhausted"]["chat"] > 0
    origin = mixed.meta["session_origin"]
    assert sorted(origin) == sorted(np.unique(chat.session).tolist())  # each session exactly once
    check_mix(mixed, [chat], group_by_pass=False)


def test_weights_respected_per_phase():
    a = synth(1, {"chat": 1}, duration=200)
    b = synth(2, {"templated": 1}, duration=200)
    c = synth(3, {"agent": 1}, duration=200)
    w = [{"a": 0.7, "b": 0.2, "c": 0.1}, {"a": 0.1, "b": 0.1, "c": 0.8}, {"a": 0.0, "b": 1.0, "c": 0.0}]
    cfg = config("abc", [{"duration": 400, "rate": 2.0, "weights": x} for x in w], seed=5)
    mixed, stats = M.interleave([a, b, c], cfg)
    comp = np.asarray(mixed.meta["session_component"])
    phase = M.phase_of(mixed)
    first = np.unique(mixed.session, return_index=True)[1]
    for i, x in enumerate(w):
        sessions = mixed.session[first][phase[first] == i]
        n = sessions.size
        assert abs(n - 800) < 5 * np.sqrt(800)
        assert stats["sessions_per_phase"][i] == {k: int((comp[sessions] == j).sum()) for j, k in enumerate("abc")}
        for j, k in enumerate("abc"):
            frac = (comp[sessions] == j).mean()
            assert abs(frac - x[k]) < 4 * np.sqrt(x[k] * (1 - x[k]) / n) + 1e-9, (i, k, frac)
    assert [p["weights"] for p in mixed.meta["phases"]] == w


def test_block_size_mismatch():
    a = synth(1, {"chat": 1}, block_size=16)
    b = synth(2, {"chat": 1}, block_size=512)
    cfg = config(["conv", "moon"], [{"duration": 10, "rate": 1.0, "weights": {"conv": 1, "moon": 1}}])
    with pytest.raises(ValueError, match=r"'moon' has block_size 512 but component 'conv' has block_size 16"):
        M.interleave([a, b], cfg)
    cfg = config(["conv"], [{"duration": 10, "rate": 1.0, "weights": {"conv": 1}}], block_size=512)
    with pytest.raises(ValueError, match=r"'conv' has block_size 16 but the mix option block_size has"):
        M.interleave([a], cfg)
    with pytest.raises(ValueError, match=r"'b' has block_size 512 but component 'a' has block_size 16"):
        load_source("mix", None, components=[
            {"name": "a", "source": "synthetic", "options": {"preset": "tiny"}},
            {"name": "b", "source": "synthetic", "options": {"preset": "tiny", "block_size": 512}}],
            phases=[{"duration": 10, "rate": 1, "weights": {"a": 1, "b": 1}}])


def test_load_from_yaml_with_relative_paths(tmp_path):
    a = synth(1, {"chat": 1})
    b = unknown_sessions_trace()
    a.save(tmp_path / "a.npz")
    b.save(tmp_path / "b.jsonl")
    (tmp_path / "sub").mkdir()
    cfg = tmp_path / "sub" / "mix.yaml"
    cfg.write_text("seed: 4\ncomponents:\n"
                   "  - {name: a, source: trace, path: ../a.npz}\n"
                   "  - {name: b, source: trace, path: ../b.jsonl}\n"
                   "  - {name: s, source: synthetic, options: {preset: tiny, seed: 9}}\n"
                   "phases:\n  - {duration: 50, rate: 1.0, weights: {a: 1, b: 1, s: 1}, name: one}\n")
    mixed, rep = load_source("mix", cfg)
    assert mixed.meta["source"] == "mix" and mixed.meta["components"] == ["a", "b", "s"]
    assert mixed.meta["phases"][0]["name"] == "one"
    s = load_source("synthetic", None, preset="tiny", seed=9)[0]
    check_mix(mixed, [a, b, s], group_by_pass=True)
    assert rep.rows_read == len(a) + len(b) + len(s)
    assert any(n.startswith("s: ") for n in rep.notes)
    # Options override the file; the same seed gives the same trace.
    again, _ = load_source("mix", cfg)
    assert again.equals(mixed)
    other, _ = load_source("mix", cfg, seed=5)
    assert not other.equals(mixed)


def test_a_mix_that_includes_itself_is_refused(tmp_path):
    """Directly or through another mix: a clear error, not a RecursionError (issue 15)."""
    phases = "phases:\n  - {duration: 10, rate: 1, weights: {x: 1}}\n"
    (tmp_path / "self.yaml").write_text("components:\n  - {name: x, source: mix, path: self.yaml}\n" + phases)
    with pytest.raises(ValueError, match="cannot include itself"):
        load_source("mix", tmp_path / "self.yaml")
    (tmp_path / "a.yaml").write_text("components:\n  - {name: x, source: mix, path: b.yaml}\n" + phases)
    (tmp_path / "b.yaml").write_text("components:\n  - {name: x, source: mix, path: a.yaml}\n" + phases)
    with pytest.raises(ValueError, match=r"a\.yaml -> .*b\.yaml -> .*a\.yaml"):
        load_source("mix", tmp_path / "a.yaml")
    # The same file twice side by side is no cycle.
    (tmp_path / "leaf.yaml").write_text("components:\n  - {name: x, source: synthetic, options: {preset: tiny}}\n"
                                        + phases)
    (tmp_path / "twice.yaml").write_text("components:\n  - {name: x, source: mix, path: leaf.yaml}\n"
                                         "  - {name: y, source: mix, path: leaf.yaml}\n"
                                         "phases:\n  - {duration: 10, rate: 1, weights: {x: 1, y: 1}}\n")
    trace, _ = load_source("mix", tmp_path / "twice.yaml")
    assert len(trace) > 0


def test_a_component_without_its_file_is_named(tmp_path):
    """A file source without a path raised a TypeError (found by the fuzz test); errors of a component name the mix
    config and the component."""
    phases = "phases:\n  - {duration: 10, rate: 1, weights: {m: 1}}\n"
    (tmp_path / "m.yaml").write_text("components:\n  - {name: m, source: mooncake}\n" + phases)
    with pytest.raises(ValueError, match=r"m\.yaml: component 'm': no file given"):
        load_source("mix", tmp_path / "m.yaml")
    (tmp_path / "n.yaml").write_text("components:\n  - {name: m, source: synthetic, options: {preset: [1]}}\n"
                                     + phases)
    with pytest.raises(ValueError, match=r"n\.yaml: component 'm': .*unknown synthetic preset \[1\]"):
        load_source("mix", tmp_path / "n.yaml")


def test_config_validation():
    comps = [{"name": "a", "source": "synthetic", "options": {"preset": "tiny"}}]
    ph = [{"duration": 10, "rate": 1, "weights": {"a": 1}}]
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['phase'\]"):
        load_source("mix", None, components=comps, phase=ph)
    with pytest.raises(ValueError, match=r"phases\[0\].weights: unknown component\(s\) \['b'\]; components: \['a'\]"):
        M.MixConfig.from_dict({"components": comps, "phases": [{"duration": 1, "rate": 1, "weights": {"b": 1}}]})
    with pytest.raises(ValueError, match=r"components\[0\]: unknown key\(s\) \['opts'\]; valid keys"):
        M.MixConfig.from_dict({"components": [{"name": "a", "source": "synthetic", "opts": {}}], "phases": ph})
    with pytest.raises(ValueError, match=r"unknown source 'nope'; valid sources"):
        M.MixConfig.from_dict({"components": [{"name": "a", "source": "nope"}], "phases": ph})
    with pytest.raises(ValueError, match=r"unique"):
        M.MixConfig.from_dict({"components": comps * 2, "phases": ph})
    with pytest.raises(ValueError, match=r"missing required key 'phases'"):
        M.MixConfig.from_dict({"components": comps})
    with pytest.raises(ValueError, match=r"phases\[0\]: duration must be > 0"):
        M.MixConfig.from_dict({"components": comps, "phases": [{"duration": -1, "rate": 1, "weights": {"a": 1}}]})
    with pytest.raises(ValueError, match=r"must not all be 0"):
        M.MixConfig.from_dict({"components": comps, "phases": [{"duration": 1, "rate": 1, "weights": {"a": 0}}]})
    with pytest.raises(ValueError, match=r"on_exhausted must be one of"):
        M.MixConfig.from_dict({"components": comps, "phases": ph, "on_exhausted": "wrap"})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['seeds'\]"):
        M.MixConfig.from_dict({"components": comps, "phases": ph, "seeds": 1})
    empty = Trace(t=[], session=[], turn=[], app=[], prompt_tokens=[], output_tokens=[], prompt_offsets=[0],
                  prompt_keys=[], prompt_types=[], block_size=16)
    with pytest.raises(ValueError, match=r"\['a'\] have no requests"):
        M.interleave([empty], config(["a"], [{"duration": 1, "rate": 1, "weights": {"a": 1}}]))


def test_salt_is_a_bijection_per_salt():
    keys = np.array([0, 1, -1, 2**62, 5, 5], dtype=np.int64)
    a = M.salt_keys(keys, 0)
    b = M.salt_keys(keys, 1)
    assert same_partition(a, keys) and same_partition(b, keys)
    assert not set(a.tolist()) & set(b.tolist())
    np.testing.assert_array_equal(M.salt_keys(keys, np.array([0, 0, 0, 0, 1, 1])), np.concatenate([a[:4], b[4:]]))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), mode=st.sampled_from(M.ON_EXHAUSTED),
       w=st.lists(st.lists(st.floats(0, 1), min_size=2, max_size=2).filter(lambda x: sum(x) > 0.01),
                  min_size=1, max_size=3),
       rate=st.floats(0.1, 2.0))
def test_random_mixes_keep_structure(seed, mode, w, rate):
    a = synth(seed % 7, {"chat": 0.5, "agent": 0.5}, duration=15, rate=1.0)
    b = unknown_sessions_trace(n=10, seed=seed % 5)
    cfg = config(["a", "b"], [{"duration": 10, "rate": rate, "weights": {"a": x[0], "b": x[1]}} for x in w],
                 seed=seed, on_exhausted=mode)
    mixed, stats = M.interleave([a, b], cfg)
    mixed.validate()
    check_mix(mixed, [a, b], group_by_pass=(mode == "cycle"))
    assert sum(stats["sessions_used"].values()) == len(mixed.meta["session_component"])
    assert mixed.t.size == 0 or mixed.t[0] >= 0


# ----------------------------------------------------------------------------------------------------------------
# Real sources: these run once the conversations / taubench / mooncake modules exist.


@pytest.fixture(scope="module")
def real_traces():
    pytest.importorskip("sae_env.sources.conversations")
    pytest.importorskip("sae_env.sources.taubench")
    return {"chat": load_source("conversations", D.WILDCHAT, block_size=16)[0],
            "agent": load_source("taubench", D.TAUBENCH)[0]}


def test_mix_real_chat_agent_and_synthetic(real_traces):
    tmpl = synth(0, {"templated": 1}, duration=300, rate=1.0)
    raw = [real_traces["chat"], real_traces["agent"], tmpl]
    assert {tr.block_size for tr in raw} == {16}
    cfg = config(["chat", "agent", "tmpl"], [
        {"duration": 300, "rate": 0.5, "weights": {"chat": 0.6, "agent": 0.2, "tmpl": 0.2}},
        {"duration": 300, "rate": 0.5, "weights": {"chat": 0.1, "agent": 0.7, "tmpl": 0.2}}], seed=1)
    mixed, stats = M.interleave(raw, cfg)
    check_mix(mixed, raw, group_by_pass=True)
    apps = {int(x) for x in np.unique(mixed.app)}
    assert {AppType.CHAT, AppType.AGENT, AppType.SINGLE_TURN} <= apps
    # The tau-bench sessions share their system + tools prefix with each other, inside the mix too.
    agent_first = (M.component_of(mixed) == 1) & (mixed.turn == 1)
    assert np.unique(mixed.prompt_keys[mixed.prompt_offsets[:-1][agent_first]]).size == 1


def test_mix_real_sources_through_the_registry(real_traces, tmp_path):
    cfg = tmp_path / "mix.yaml"
    cfg.write_text(f"seed: 2\ncomponents:\n"
                   f"  - {{name: chat, source: conversations, path: '{D.WILDCHAT}', options: {{block_size: 16}}}}\n"
                   f"  - {{name: tmpl, source: synthetic, options: {{preset: tiny}}}}\n"
                   f"phases:\n  - {{duration: 200, rate: 0.5, weights: {{chat: 0.5, tmpl: 0.5}}}}\n")
    mixed, rep = load_source("mix", cfg)
    raw = [real_traces["chat"], load_source("synthetic", None, preset="tiny")[0]]
    expected, _ = M.interleave(raw, M.MixConfig.from_dict(S.read_config_file(cfg)))
    assert mixed.equals(expected)
    assert rep.rows_read == 187 + len(raw[1])  # WildChat: 187 conversations; synthetic: one row per request


def test_mix_mooncake_needs_matching_block_size(real_traces):
    pytest.importorskip("sae_env.sources.mooncake")
    moon = load_source("mooncake", D.MOONCAKE_ARXIV)[0]
    assert moon.block_size == 512
    cfg = config(["moon", "chat"], [{"duration": 100, "rate": 0.5, "weights": {"moon": 0.5, "chat": 0.5}}])
    with pytest.raises(ValueError, match=r"'chat' has block_size 16 but component 'moon' has block_size 512"):
        M.interleave([moon, real_traces["chat"]], cfg)
    chat512 = load_source("conversations", D.WILDCHAT, block_size=512)[0]
    mixed, _ = M.interleave([moon, chat512], cfg)
    assert mixed.block_size == 512
    check_mix(mixed, [moon, chat512], group_by_pass=True)
