"""The Mooncake source: facts measured on the real files, the session / type inference against simple reference
code, the chaining property, bad input, and loading throughput."""

import collections
import gzip
import json
import math
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sae_env.data import MOONCAKE_ARXIV, MOONCAKE_SYNTHETIC
from sae_env.sources import load_source, mooncake
from sae_env.sources.hashonly import compact, successor_counts
from sae_env.trace import AppType, TokenType, Trace, TraceFormatError, chain_keys

SHARED = Path("/work/shared/data/mooncake")
ARXIV_PLAIN = SHARED / "arxiv_trace_first1000.jsonl"
SYNTH_PLAIN = SHARED / "synthetic_trace.jsonl"
BS = 512


def n_distinct(a):
    """Distinct values by sorting (numpy 2.4's bare np.unique takes seconds on a million int64 keys)."""
    s = np.sort(np.asarray(a))
    return int(s.size and 1 + (s[1:] != s[:-1]).sum())


def _rows(path):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def arxiv():
    return mooncake.load(MOONCAKE_ARXIV)


@pytest.fixture(scope="module")
def synth():
    return mooncake.load(MOONCAKE_SYNTHETIC)


@pytest.fixture(scope="module")
def arxiv_rows():
    return _rows(MOONCAKE_ARXIV)


@pytest.fixture(scope="module")
def synth_rows():
    return _rows(MOONCAKE_SYNTHETIC)


# -- reference code (plain Python on the raw ids, which are prefix-chained in these files) ---------------------------


def ref_successors(rows):
    succ = collections.defaultdict(set)
    for r in rows:
        h = r["hash_ids"]
        for a, b in zip(h, h[1:], strict=False):
            succ[a].add(b)
    return succ


def ref_parents(rows, hub_min, max_gap_s=None):
    succ = ref_successors(rows)
    ends, parents = {}, []
    for i, r in enumerate(rows):
        h, nf = r["hash_ids"], r["input_length"] // BS
        best = -1
        for p in range(nf):
            if len(succ[h[p]]) < hub_min:
                best = max(best, ends.get(h[p], -1))
        if best >= 0 and max_gap_s is not None and (r["timestamp"] - rows[best]["timestamp"]) / 1000 > max_gap_s:
            best = -1
        parents.append(best)
        if nf:
            ends[h[nf - 1]] = i
    return parents


def ref_types(rows, parents, shared_min):
    root = list(range(len(rows)))
    for i, p in enumerate(parents):
        if p >= 0:
            root[i] = root[p]
    sessions = collections.defaultdict(set)
    for i, r in enumerate(rows):
        for x in r["hash_ids"][: r["input_length"] // BS]:
            sessions[x].add(root[i])
    out = []
    for i, r in enumerate(rows):
        full = r["hash_ids"][: r["input_length"] // BS]
        head = 0
        while head < len(full) and len(sessions[full[head]]) >= shared_min:
            head += 1
        par = parents[i]
        inh, m = 0, 0
        if par >= 0:
            pfull = rows[par]["hash_ids"][: rows[par]["input_length"] // BS]
            while inh < min(len(full), len(pfull)) and full[inh] == pfull[inh]:
                inh += 1
            m = math.ceil(rows[par]["output_length"] / BS)
        types = []
        for p in range(len(full)):
            if p < head:
                types.append(TokenType.SYSTEM if p == 0 else TokenType.TEMPLATE)
            elif p < inh:
                types.append(out[par][p])
            elif p - max(inh, head) < m:
                types.append(TokenType.ASSISTANT)
            else:
                types.append(TokenType.USER)
        out.append(types)
    return out


# -- measured facts -------------------------------------------------------------------------------------------------


def test_arxiv_facts(arxiv, arxiv_rows):
    trace, report = arxiv
    assert len(trace) == report.rows_read == 1000 and report.rows_rejected == 0
    assert trace.t[0] == 0.0 and trace.t[-1] == pytest.approx(177.098)
    assert trace.block_size == BS and trace.meta["source"] == "mooncake"
    assert all(len(r["hash_ids"]) == math.ceil(r["input_length"] / BS) for r in arxiv_rows)
    assert sum(len(r["hash_ids"]) for r in arxiv_rows) == 19686
    # 997 rows end with a partial block: dropped from the keys, still counted in prompt_tokens.
    assert trace.meta["partial_blocks_dropped"] == 997 and any("997 partial" in n for n in report.notes)
    assert trace.n_blocks == 19686 - 997 == 18689
    assert np.array_equal(trace.prompt_tokens, [r["input_length"] for r in arxiv_rows])
    assert np.array_equal(trace.output_tokens, [r["output_length"] for r in arxiv_rows])
    assert np.array_equal(np.diff(trace.prompt_offsets), [r["input_length"] // BS for r in arxiv_rows])
    assert trace.n_output_blocks == 0


def test_synthetic_facts_and_reuse_fraction(synth, synth_rows):
    trace, report = synth
    assert len(trace) == 3993 and trace.t[-1] == pytest.approx(1022.025)
    assert all(len(r["hash_ids"]) == math.ceil(r["input_length"] / BS) for r in synth_rows)
    raw = [x for r in synth_rows for x in r["hash_ids"]]
    raw_reuse = 1 - len(set(raw)) / len(raw)
    # The README's "64 % of block references are reuses" counts every id, partial last blocks included.
    assert len(raw) == 121877 and raw_reuse == pytest.approx(0.6396, abs=1e-4)
    # Without partial blocks (only full blocks are cache keys) the fraction rises to 65.9 %: a partial block is
    # the unique tail of one prompt and almost never reused (194 of 3,989 partial ids recur), so dropping them
    # removes non-reuses from the denominator.
    keyed_reuse = 1 - n_distinct(trace.prompt_keys) / trace.n_blocks
    assert trace.n_blocks == 117888 and keyed_reuse == pytest.approx(0.6594, abs=1e-4)
    assert trace.meta["partial_blocks_dropped"] == 3989


def test_arxiv_reuse_fraction(arxiv, arxiv_rows):
    raw = [x for r in arxiv_rows for x in r["hash_ids"]]
    assert 1 - len(set(raw)) / len(raw) == pytest.approx(0.3799, abs=1e-4)
    trace, _ = arxiv
    assert 1 - n_distinct(trace.prompt_keys) / trace.n_blocks == pytest.approx(0.3996, abs=1e-4)


def test_embedded_and_shared_copies_give_the_same_trace(arxiv, synth):
    assert mooncake.load(ARXIV_PLAIN)[0].equals(arxiv[0])
    assert mooncake.load(SYNTH_PLAIN)[0].equals(synth[0])


def test_registry_and_npz_round_trip(arxiv, tmp_path):
    trace, _ = load_source("mooncake", MOONCAKE_ARXIV)
    assert trace.equals(arxiv[0])
    back = Trace.load(trace.save(tmp_path / "a.npz"))
    assert back.equals(trace) and back.meta["hub_min_successors"] == 16


# -- hubs and sessions ---------------------------------------------------------------------------------------------


def test_successor_counts_justify_the_hub_default(arxiv_rows, synth_rows):
    succ = ref_successors(arxiv_rows)
    counts = sorted(((len(v), k) for k, v in succ.items()), reverse=True)
    # The three template heads, then a gap: every other block has at most 3 successors.
    assert counts[:3] == [(401, 0), (356, 57), (152, 78)] and counts[3][0] == 3
    assert max(len(v) for v in ref_successors(synth_rows).values()) == 13
    assert 13 < mooncake.DEFAULTS["hub_min_successors"] < 152


@pytest.mark.parametrize("which", ["arxiv", "synth"])
def test_vectorised_successor_counts_match_reference(which, arxiv_rows, synth_rows):
    rows = arxiv_rows if which == "arxiv" else synth_rows
    ids = np.array([x for r in rows for x in r["hash_ids"]], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum([len(r["hash_ids"]) for r in rows])])
    kid, n = compact(chain_keys(ids, offsets))
    succ = ref_successors(rows)
    assert np.array_equal(successor_counts(kid, n, offsets), [len(succ[x]) for x in ids.tolist()])


def test_arxiv_sessions(arxiv, arxiv_rows):
    trace, report = arxiv
    parents = ref_parents(arxiv_rows, hub_min=16)
    linked = sum(p >= 0 for p in parents)
    assert linked == 77 == int((trace.turn > 1).sum())
    assert n_distinct(trace.session) == 923 and trace.session.max() == 922
    assert np.bincount(trace.turn).tolist() == [0, 923, 65, 11, 1]
    sizes = np.bincount(trace.session)
    assert int((sizes > 1).sum()) == 65
    chat = trace.app == AppType.CHAT
    assert np.array_equal(chat, sizes[trace.session] > 1)
    assert int(chat.sum()) == 142
    # Fraction of chat requests that are a later turn: 77 / 142.
    assert (trace.turn[chat] > 1).mean() == pytest.approx(77 / 142)
    assert any("923 sessions" in n for n in report.notes)


def test_arxiv_app_inference_against_the_first_block_families(arxiv, arxiv_rows):
    trace, _ = arxiv
    first = np.array([r["hash_ids"][0] for r in arxiv_rows])
    fam = {"chat": first == 0, "template12": (first >= 46) & (first <= 57), "template5": (first >= 74) & (first <= 78)}
    assert [int(m.sum()) for m in fam.values()] == [486, 361, 153]
    assert int(sum(fam.values()).sum()) == 1000
    chat = trace.app == AppType.CHAT
    # Within 177 s most chat turns have no neighbour turn in the excerpt (median gap ~2 min): only 131 of the
    # 486 chat-family requests are found in multi-request sessions. The template families stay nearly all
    # SINGLE_TURN (a handful repeat the same long document after the template).
    assert [int((m & chat).sum()) for m in fam.values()] == [131, 9, 2]


def test_synthetic_sessions(synth, synth_rows):
    trace, _ = synth
    parents = ref_parents(synth_rows, hub_min=16)
    assert sum(p >= 0 for p in parents) == 1455 == int((trace.turn > 1).sum())
    assert n_distinct(trace.session) == 2538 and int(trace.turn.max()) == 24
    sizes = np.bincount(trace.session)
    assert int((sizes > 1).sum()) == 309
    chat = trace.app == AppType.CHAT
    assert int(chat.sum()) == 1764 and (trace.turn[chat] > 1).mean() == pytest.approx(1455 / 1764)


@pytest.mark.parametrize("hub_min", [2, 3, 16, 10**9])
def test_parents_match_reference(hub_min, arxiv_rows):
    trace, _ = mooncake.load(MOONCAKE_ARXIV, hub_min_successors=hub_min)
    parents = ref_parents(arxiv_rows, hub_min)
    turn = [1] * len(parents)
    root = list(range(len(parents)))
    for i, p in enumerate(parents):
        if p >= 0:
            turn[i], root[i] = turn[p] + 1, root[p]
    assert trace.turn.tolist() == turn
    # Same partition into sessions (ids are dense, in order of the first request).
    assert np.array_equal(compact(np.array(root))[0], trace.session)


def test_without_hubs_templates_merge_into_giant_sessions():
    trace, _ = mooncake.load(MOONCAKE_ARXIV, hub_min_successors=10**9)
    assert n_distinct(trace.session) == 24 and int(trace.turn.max()) == 182


def test_hub_default_is_safe_on_a_short_excerpt(tmp_path, arxiv_rows):
    path = tmp_path / "first100.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in arxiv_rows[:100]))
    assert len(ref_successors(arxiv_rows[:100])[78]) == 18
    trace, _ = mooncake.load(path)
    assert int((trace.turn > 1).sum()) == 0
    # A higher threshold misses the small template's hub and chains unrelated template requests.
    trace, _ = mooncake.load(path, hub_min_successors=32)
    assert int((trace.turn > 1).sum()) == 38 and int(trace.turn.max()) == 15


def test_max_gap_limits_links(arxiv_rows):
    trace, report = mooncake.load(MOONCAKE_ARXIV, max_gap_s=30.0)
    parents = ref_parents(arxiv_rows, hub_min=16, max_gap_s=30.0)
    assert int((trace.turn > 1).sum()) == sum(p >= 0 for p in parents) < 77
    assert any("max_gap_s=30.0" in n for n in report.notes)


# -- types -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["arxiv", "synth"])
def test_types_match_reference(which, arxiv, synth, arxiv_rows, synth_rows):
    trace, _ = arxiv if which == "arxiv" else synth
    rows = arxiv_rows if which == "arxiv" else synth_rows
    expected = ref_types(rows, ref_parents(rows, 16), shared_min=3)
    assert trace.prompt_types.tolist() == [int(x) for ts in expected for x in ts]


def test_arxiv_types_find_the_template_heads(arxiv, arxiv_rows):
    trace, _ = arxiv
    assert np.bincount(trace.prompt_types, minlength=7).tolist() == [1000, 4583, 13043, 63, 0, 0, 0]
    head_len = {0: 1, 46: 12, 74: 5}
    for i, r in enumerate(arxiv_rows):
        _, types = trace.prompt_blocks(i)
        h = head_len[r["hash_ids"][0]]
        assert types[0] == TokenType.SYSTEM
        assert (types[1:h] == TokenType.TEMPLATE).all() and not (types[h:] == TokenType.TEMPLATE).any()


def test_assistant_blocks_follow_the_inherited_history(arxiv, arxiv_rows):
    trace, _ = arxiv
    parents = ref_parents(arxiv_rows, 16)
    i = next(k for k, p in enumerate(parents) if p >= 0)
    p = parents[i]
    n_par = arxiv_rows[p]["input_length"] // BS
    _, types = trace.prompt_blocks(i)
    _, ptypes = trace.prompt_blocks(p)
    assert np.array_equal(types[:n_par], ptypes)
    m = math.ceil(arxiv_rows[p]["output_length"] / BS)
    assert (types[n_par:n_par + m] == TokenType.ASSISTANT).all()
    assert (types[n_par + m:] == TokenType.USER).all()


# -- chaining --------------------------------------------------------------------------------------------------------


def _same_equalities(a, b):
    """Equal at positions (x, y) in ``a`` iff equal in ``b``, for every pair: the pairing is a bijection."""
    a, b = a.tolist(), b.tolist()
    return len(set(a)) == len(set(b)) == len(set(zip(a, b, strict=True)))


@pytest.mark.parametrize("which", ["arxiv", "synth"])
def test_chaining_real_ids_keeps_every_equality(which, arxiv, synth, arxiv_rows, synth_rows):
    trace, _ = arxiv if which == "arxiv" else synth
    rows = arxiv_rows if which == "arxiv" else synth_rows
    raw = np.array([x for r in rows for x in r["hash_ids"][: r["input_length"] // BS]], dtype=np.int64)
    assert raw.size == trace.n_blocks
    assert _same_equalities(raw, trace.prompt_keys)
    assert not np.array_equal(raw, trace.prompt_keys)  # they did go through chain_keys


@st.composite
def mooncake_like(draw):
    """Requests drawn as walks in a small trie; Mooncake ids = one id per trie node (already prefix-chained)."""
    walks = draw(st.lists(st.lists(st.integers(0, 3), max_size=7), min_size=1, max_size=10))
    node_id = {}
    ids = []
    for w in walks:
        for j in range(len(w)):
            ids.append(node_id.setdefault(tuple(w[: j + 1]), len(node_id) * 7 + 3))
    offsets = np.concatenate([[0], np.cumsum([len(w) for w in walks])]).astype(np.int64)
    return np.array(ids, dtype=np.int64), offsets


@given(mooncake_like(), st.integers(0, 5))
@settings(max_examples=100, deadline=None)
def test_chaining_prechained_ids_changes_no_equality(data, salt):
    ids, offsets = data
    keys = chain_keys(ids, offsets, salt=salt)
    assert np.array_equal(ids[:, None] == ids[None, :], keys[:, None] == keys[None, :])


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 4), st.integers(0, 1200)), min_size=1, max_size=12),
       st.integers(2, 4))
@settings(max_examples=60, deadline=None)
def test_loader_matches_reference_on_generated_files(tmp_path_factory, spec, hub_min):
    """Random small traces in Mooncake format: parents, turns and types equal the reference code's."""
    rows, nid, history = [], 100, {}
    for k, (base, new_blocks, out) in enumerate(spec):
        prev = history.get(base, [base])
        ids = prev + list(range(nid, nid + new_blocks))
        nid += new_blocks
        il = (len(ids) - 1) * BS + 1 + (k * 97) % BS
        rows.append({"timestamp": k * 1000, "input_length": il, "output_length": out, "hash_ids": ids})
        history[base] = ids[:-1]
    path = tmp_path_factory.mktemp("gen") / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trace, _ = mooncake.load(path, hub_min_successors=hub_min, shared_min_sessions=2)
    parents = ref_parents(rows, hub_min)
    expected = ref_types(rows, parents, shared_min=2)
    assert trace.prompt_types.tolist() == [int(x) for ts in expected for x in ts]
    assert int((trace.turn > 1).sum()) == sum(p >= 0 for p in parents)


# -- partial blocks, ordering, options ---------------------------------------------------------------------------------


def _write(tmp_path, rows, name="t.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_full_last_block_is_kept_and_partial_dropped(tmp_path):
    path = _write(tmp_path, [
        {"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]},
        {"timestamp": 10, "input_length": 1025, "output_length": 5, "hash_ids": [1, 2, 3]},
        {"timestamp": 20, "input_length": 0, "output_length": 5, "hash_ids": []},
        {"timestamp": 30, "input_length": 100, "output_length": 5, "hash_ids": [9]},
    ])
    trace, report = mooncake.load(path)
    assert np.diff(trace.prompt_offsets).tolist() == [2, 2, 0, 0]
    assert trace.prompt_tokens.tolist() == [1024, 1025, 0, 100]
    assert trace.meta["partial_blocks_dropped"] == 2
    assert np.array_equal(trace.prompt_keys[:2], trace.prompt_keys[2:4])
    assert trace.t.tolist() == [0.0, 0.01, 0.02, 0.03]
    # Request 1 extends request 0's full list: its previous turn.
    assert trace.turn.tolist() == [1, 2, 1, 1] and trace.session[0] == trace.session[1]


def test_out_of_order_rows_are_sorted_and_counted(tmp_path):
    path = _write(tmp_path, [
        {"timestamp": 5000, "input_length": 10, "output_length": 1, "hash_ids": [1]},
        {"timestamp": 1000, "input_length": 10, "output_length": 1, "hash_ids": [2]},
    ])
    trace, report = mooncake.load(path)
    assert trace.t.tolist() == [1.0, 5.0]
    assert any("1000" not in n and "sorted stably" in n and "2 rows moved" in n for n in report.notes)


def test_unknown_and_bad_options():
    with pytest.raises(ValueError, match="unknown option.*hub_min"):
        mooncake.load(MOONCAKE_ARXIV, hub_min=3)
    with pytest.raises(ValueError, match="hub_min_successors"):
        mooncake.load(MOONCAKE_ARXIV, hub_min_successors=1)
    with pytest.raises(ValueError, match="max_gap_s"):
        mooncake.load(MOONCAKE_ARXIV, max_gap_s=-1)
    with pytest.raises(ValueError, match="on_error"):
        mooncake.load(MOONCAKE_ARXIV, on_error="ignore")
    with pytest.raises(FileNotFoundError):
        mooncake.load("/nonexistent/trace.jsonl")


def test_salt_separates_key_spaces(arxiv):
    salted, _ = mooncake.load(MOONCAKE_ARXIV, salt=7)
    assert not set(salted.prompt_keys.tolist()) & set(arxiv[0].prompt_keys.tolist())
    assert np.array_equal(salted.turn, arxiv[0].turn) and np.array_equal(salted.prompt_types, arxiv[0].prompt_types)


# -- bad input -------------------------------------------------------------------------------------------------------

GOOD = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}


def _bad(**change):
    row = dict(GOOD)
    for k, v in change.items():
        if v is KeyError:
            del row[k]
        else:
            row[k] = v
    return row


BAD_ROWS = [
    ('{"timestamp": 0, "input_length": 600,', None, "malformed JSON"),
    ("[1, 2]", None, "expected a JSON object"),
    (_bad(timestamp=KeyError), "timestamp", "missing"),
    (_bad(timestamp="0"), "timestamp", "must be a number"),
    (_bad(timestamp=-5), "timestamp", ">= 0"),
    (_bad(input_length=600.0), "input_length", "must be an integer"),
    (_bad(input_length=True), "input_length", "must be an integer"),
    (_bad(output_length=-1), "output_length", ">= 0"),
    (_bad(output_length=10**30), "output_length", "at most 100,000,000 tokens"),
    # issue 15: values past the stated bounds, lists nested in hash_ids, JSON true read as id 1
    (_bad(input_length=10**400), "input_length", "at most 100,000,000 tokens, got 1000"),
    (_bad(timestamp=10**400), "timestamp", r"at most 1e\+13 ms"),
    (_bad(timestamp=2**63), "timestamp", r"at most 1e\+13 ms"),
    (_bad(timestamp=1e300), "timestamp", r"at most 1e\+13 ms"),
    (_bad(hash_ids=[1, [2]]), "hash_ids", "element 1 must be an integer, got \\[2\\]"),
    (_bad(hash_ids=[1, True]), "hash_ids", "element 1 must be an integer, got True"),
    (_bad(hash_ids=[1, 10**400]), "hash_ids", "element 1 must lie"),
    (_bad(hash_ids=KeyError), "hash_ids", "missing"),
    (_bad(hash_ids="1,2"), "hash_ids", "list of integers"),
    (_bad(hash_ids=[1, 2, 3]), "hash_ids", "has 3 ids but input_length=600 needs ceil"),
    (_bad(hash_ids=[1]), "hash_ids", "has 1 ids"),
    (_bad(hash_ids=[1, "2"]), "hash_ids", "element 1 must be an integer"),
    (_bad(hash_ids=[1, 2.5]), "hash_ids", "element 1 must be an integer"),
    (_bad(hash_ids=[-1, 2]), "hash_ids", r"element 0 must lie in \[0, 2\*\*64\)"),
    (_bad(hash_ids=[1, 2**64]), "hash_ids", "element 1 must lie"),
]


@pytest.mark.parametrize("bad,field,message", BAD_ROWS)
def test_bad_row_names_file_line_and_field(tmp_path, bad, field, message):
    path = _write(tmp_path, [GOOD, "", _bad(timestamp=10), bad, _bad(timestamp=20)])
    with pytest.raises(TraceFormatError, match=message) as exc:
        mooncake.load(path)
    err = exc.value
    assert err.line == 4 and err.field == field and str(path) in str(err) and "line 4" in str(err)
    trace, report = mooncake.load(path, on_error="skip")
    assert len(trace) == 3 and report.rows_read == 4 and report.rows_rejected == 1
    assert sum(report.rejected.values()) == 1


def test_large_ids_below_2_64_are_valid(tmp_path):
    path = _write(tmp_path, [_bad(hash_ids=[2**63 + 5, 1]), _bad(timestamp=1, hash_ids=[2**63 + 5, 2])])
    trace, _ = mooncake.load(path)
    assert trace.n_blocks == 2 and trace.prompt_keys[0] == trace.prompt_keys[1]


def test_earliest_error_is_reported_first(tmp_path):
    # A bad id element (found by the batch check) on line 2 comes before a missing field on line 3.
    path = _write(tmp_path, [GOOD, _bad(hash_ids=[1, "x"]), _bad(output_length=KeyError)])
    with pytest.raises(TraceFormatError) as exc:
        mooncake.load(path)
    assert exc.value.line == 2 and exc.value.field == "hash_ids"
    trace, report = mooncake.load(path, on_error="skip")
    assert len(trace) == 1 and report.rejected == {"hash_ids: wrong type or value": 1, "output_length: missing": 1}


def test_skip_counts_by_reason(tmp_path):
    path = _write(tmp_path, [GOOD, "{oops", "{oops", _bad(timestamp=-1), _bad(hash_ids=[1, 2, 3]), GOOD])
    trace, report = mooncake.load(path, on_error="skip")
    assert len(trace) == 2 and report.rows_read == 6 and report.rows_rejected == 4
    assert report.rejected == {"malformed JSON": 2, "timestamp: wrong type or value": 1,
                               "hash_ids: length mismatch": 1}


def test_empty_and_all_bad_files(tmp_path):
    for content in ("", "\n  \n"):
        path = tmp_path / "empty.jsonl"
        path.write_text(content)
        with pytest.raises(TraceFormatError, match="empty file"):
            mooncake.load(path)
        with pytest.raises(TraceFormatError, match="empty file"):
            mooncake.load(path, on_error="skip")
    path = _write(tmp_path, ["{bad", "{bad"])
    with pytest.raises(TraceFormatError, match="no valid rows"):
        mooncake.load(path, on_error="skip")


def test_undecodable_input(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"timestamp": "\xe9t\xe9"}\n')
    with pytest.raises(TraceFormatError, match="not UTF-8") as exc:
        mooncake.load(path)
    assert exc.value.line == 2
    trace, report = mooncake.load(path, on_error="skip")
    assert len(trace) == 1 and report.rejected == {"not UTF-8 text": 1}
    truncated = tmp_path / "cut.jsonl.gz"
    truncated.write_bytes(MOONCAKE_ARXIV.read_bytes()[:20_000])
    with pytest.raises(TraceFormatError, match="unreadable gzip stream after line"):
        mooncake.load(truncated, on_error="skip")


def test_gzip_input(tmp_path):
    path = tmp_path / "t.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps(GOOD) + "\n")
    trace, _ = mooncake.load(path)
    assert len(trace) == 1 and trace.n_blocks == 1


# -- throughput ------------------------------------------------------------------------------------------------------


def write_mooncake_like(path, n_blocks, seed=0):
    """A Mooncake-format file of ~n_blocks ids: sessions of 1-5 turns under three shared heads (1, 12, 5 blocks)."""
    rng = np.random.default_rng(seed)
    nid, heads = 0, []
    for size in (1, 12, 5):
        heads.append(list(range(nid, nid + size)))
        nid += size
    rows, total = [], 0
    while total < n_blocks:
        hist = list(heads[int(rng.integers(3))])
        t = float(rng.uniform(0, 3_600_000))
        for _ in range(int(rng.integers(1, 6))):
            u = int(rng.integers(0, 40))
            ids = hist + list(range(nid, nid + u + 1))
            nid += u + 1
            il = (len(ids) - 1) * BS + int(rng.integers(1, BS))
            ol = int(rng.integers(1, 800))
            rows.append((int(t), il, ol, ids))
            total += len(ids)
            n_out = -(-ol // BS)
            hist = ids[:-1] + list(range(nid, nid + n_out))
            nid += n_out
            t += float(rng.lognormal(11.7, 1.0))
    rows.sort(key=lambda r: r[0])
    with open(path, "w") as f:
        for ts, il, ol, ids in rows:
            f.write(json.dumps({"timestamp": ts, "input_length": il, "output_length": ol, "hash_ids": ids}) + "\n")
    return len(rows), total


def _throughput(path, n_ids, repeats=1):
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        trace, _ = mooncake.load(path)
        best = min(best, time.process_time() - t0)
    return trace, n_ids / best


def test_throughput_on_the_synthetic_trace(synth_rows, capsys):
    trace, rate = _throughput(MOONCAKE_SYNTHETIC, 121877, repeats=3)
    with capsys.disabled():
        print(f"\nmooncake synthetic_trace: {rate:,.0f} blocks/s (CPU time, best of 3)")
    assert rate > 100_000


@pytest.mark.slow
def test_a_million_block_trace_loads_in_a_few_seconds(tmp_path, capsys):
    path = tmp_path / "million.jsonl"
    n_rows, n_ids = write_mooncake_like(path, 1_000_000)
    trace, rate = _throughput(path, n_ids, repeats=2)
    with capsys.disabled():
        print(f"\nmooncake {n_ids:,} ids in {n_rows:,} rows: {rate:,.0f} blocks/s ({n_ids / rate:.2f} s CPU)")
    assert len(trace) == n_rows and n_ids / rate < 5.0
    # The generator's three heads are hubs; its sessions are found.
    assert trace.meta["hub_min_successors"] == 16 and int((trace.turn > 1).sum()) > 0
