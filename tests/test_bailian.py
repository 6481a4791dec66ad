"""The Bailian (Qwen trace A) source: facts pinned on the 22-row excerpt, re-chaining of content hashes, sessions
through parent_chat_id, structural types, and bad input."""

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sae_env.data import BAILIAN
from sae_env.sources import bailian, load_source
from sae_env.trace import AppType, TokenType, Trace, TraceFormatError, chain_keys

PLAIN = Path("/work/shared/data/qwen_bailian/traceA_excerpt_22rows.jsonl")
BS = 16
HEAD45 = [121, 261, 357, 411, 555, 579, 669, 716, 722, 790, 816, 993, 1287, 1311]
HEAD3 = [239, 457, 633, 1022, 1233, 1334]


@pytest.fixture(scope="module")
def loaded():
    return bailian.load(BAILIAN)


@pytest.fixture(scope="module")
def rows():
    with gzip.open(BAILIAN, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def _index(trace):
    return {c: i for i, c in enumerate(trace.meta["chat_id"])}


def test_excerpt_facts(loaded, rows):
    trace, report = loaded
    assert len(trace) == report.rows_read == 22 and report.rows_rejected == 0
    assert trace.t[0] == pytest.approx(44.073) and trace.duration == pytest.approx(359.113)
    assert trace.block_size == BS and trace.meta["source"] == "bailian"
    assert all(len(r["hash_ids"]) == math.ceil(r["input_length"] / BS) for r in rows)
    assert sum(len(r["hash_ids"]) for r in rows) == 2118
    assert trace.meta["partial_blocks_dropped"] == 21 and trace.n_blocks == 2118 - 21
    assert np.array_equal(np.diff(trace.prompt_offsets), [r["input_length"] // BS for r in rows])
    assert trace.prompt_tokens.tolist() == [r["input_length"] for r in rows]
    assert trace.n_output_blocks == 0
    assert trace.meta["request_type"].count("text") == 18
    assert trace.meta["request_type"].count("search") == trace.meta["request_type"].count("file") == 2
    idx = _index(trace)
    assert trace.meta["request_type"][idx[790]] == "search" and trace.meta["request_type"][idx[215]] == "file"


def test_embedded_and_shared_copies_agree(loaded):
    assert bailian.load(PLAIN)[0].equals(loaded[0])
    assert load_source("bailian", BAILIAN)[0].equals(loaded[0])


def test_npz_round_trip_keeps_meta(loaded, tmp_path):
    trace = loaded[0]
    back = Trace.load(trace.save(tmp_path / "b.npz"))
    assert back.equals(trace) and back.meta["request_type"] == trace.meta["request_type"]


def test_shared_heads(loaded, rows):
    trace, _ = loaded
    assert [r["chat_id"] for r in rows if r["hash_ids"][:45] == list(range(45))] == HEAD45
    assert [r["chat_id"] for r in rows if r["hash_ids"][:3] == [1089, 1090, 1091]] == HEAD3
    idx = _index(trace)
    for chat in HEAD45 + HEAD3:
        keys, types = trace.prompt_blocks(idx[chat])
        h = 45 if chat in HEAD45 else 3
        assert types[0] == TokenType.SYSTEM and (types[1:h] == TokenType.TEMPLATE).all()
        assert not np.isin(types[h:], [TokenType.SYSTEM, TokenType.TEMPLATE]).any()
    # The 45-block head is one run of keys shared by all 14 rows; 1089..1091 by 6 (its own key space).
    heads = np.array([trace.prompt_blocks(idx[c])[0][:45] for c in HEAD45])
    assert (heads == heads[0]).all()
    # The file chat (215 -> 328) has no shared head: its first blocks are used by one session only.
    for chat in (215, 328):
        assert trace.prompt_blocks(idx[chat])[1][0] == TokenType.USER
    assert np.bincount(trace.prompt_types, minlength=7).tolist() == [20, 628, 1237, 212, 0, 0, 0]


def test_sessions_follow_parent_chat_id(loaded):
    trace, report = loaded
    idx = _index(trace)
    chain = [555, 722, 816, 993]
    assert len({int(trace.session[idx[c]]) for c in chain}) == 1
    assert [int(trace.turn[idx[c]]) for c in chain] == [1, 2, 3, 4]
    assert int((trace.session == trace.session[idx[993]]).sum()) == 4
    for a, b in [(215, 328), (357, 579), (121, 716), (261, 1311), (1022, 1233)]:
        assert trace.session[idx[a]] == trace.session[idx[b]] and trace.turn[idx[b]] == trace.turn[idx[a]] + 1
    assert len(set(trace.session.tolist())) == 14 and trace.session.max() == 13
    chat = {c for c in trace.meta["chat_id"] if trace.app[idx[c]] == AppType.CHAT}
    assert chat == {121, 215, 261, 328, 357, 555, 579, 716, 722, 816, 993, 1022, 1233, 1311}
    assert trace.meta["parents_missing"] == 0 and any("14 sessions" in n for n in report.notes)


def test_types_inherit_and_mark_the_previous_answer(loaded, rows):
    trace, _ = loaded
    idx = _index(trace)
    by_chat = {r["chat_id"]: r for r in rows}
    for child, parent in [(722, 555), (816, 722), (993, 816), (328, 215), (1233, 1022), (1311, 261), (716, 121)]:
        ck, ct = trace.prompt_blocks(idx[child])
        pk, pt = trace.prompt_blocks(idx[parent])
        inh = 0
        while inh < min(ck.size, pk.size) and ck[inh] == pk[inh]:
            inh += 1
        assert np.array_equal(ct[:inh], pt[:inh])
        m = math.ceil(by_chat[parent]["output_length"] / BS)
        assert (ct[inh:inh + m] == TokenType.ASSISTANT).all() and (ct[inh + m:] == TokenType.USER).all()
    # 328 continues the file chat 215: 6 inherited blocks, then ceil(415 / 16) = 26 ASSISTANT blocks.
    _, t328 = trace.prompt_blocks(idx[328])
    assert (t328[:6] == TokenType.USER).all() and (t328[6:32] == TokenType.ASSISTANT).all()


def test_content_hashes_are_rechained(loaded, rows):
    trace, _ = loaded
    # Id 1086 is the same 5-token partial block after four different prefixes: equal content ids, different
    # prefixes. Chained, those four blocks get four different keys.
    ends = [r for r in rows if r["hash_ids"][-1] == 1086]
    assert [r["chat_id"] for r in ends] == [239, 357, 555, 1233]
    ids = np.array([x for r in rows for x in r["hash_ids"]], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum([len(r["hash_ids"]) for r in rows])])
    keys = chain_keys(ids, offsets)
    last = offsets[1:] - 1
    tails = keys[last[[rows.index(r) for r in ends]]]
    assert len(set(tails.tolist())) == 4
    # Keys of the full blocks equal iff their whole prefixes are equal (reference: tuples of ids).
    prefixes = [tuple(r["hash_ids"][: j + 1]) for r in rows for j in range(r["input_length"] // BS)]
    k = trace.prompt_keys.tolist()
    assert len(set(zip(prefixes, k, strict=True))) == len(set(prefixes)) == len(set(k))


def ref_load(rows, shared_min=3):
    """Plain-Python reference: keys as prefix tuples, sessions by following parents, structural types."""
    by_chat = {r["chat_id"]: i for i, r in enumerate(rows)}
    parent = [by_chat.get(r["parent_chat_id"], -1) for r in rows]
    root = list(range(len(rows)))
    for i, p in enumerate(parent):  # rows are in time order, parents first
        if p >= 0:
            root[i] = root[p]
    full = [[tuple(r["hash_ids"][: j + 1]) for j in range(r["input_length"] // BS)] for r in rows]
    sessions = {}
    for i, prefixes in enumerate(full):
        for x in prefixes:
            sessions.setdefault(x, set()).add(root[i])
    types = []
    for i, prefixes in enumerate(full):
        head = 0
        while head < len(prefixes) and len(sessions[prefixes[head]]) >= shared_min:
            head += 1
        p, inh, m = parent[i], 0, 0
        if p >= 0:
            while inh < min(len(prefixes), len(full[p])) and prefixes[inh] == full[p][inh]:
                inh += 1
            m = math.ceil(rows[p]["output_length"] / BS)
        t = []
        for j in range(len(prefixes)):
            if j < head:
                t.append(TokenType.SYSTEM if j == 0 else TokenType.TEMPLATE)
            elif j < inh:
                t.append(types[p][j])
            elif j - max(inh, head) < m:
                t.append(TokenType.ASSISTANT)
            else:
                t.append(TokenType.USER)
        types.append(t)
    return [x for f in full for x in f], root, types


@st.composite
def bailian_rows(draw):
    """Small Bailian-format files: content ids from a tiny alphabet (so equal ids after different prefixes are
    common), parents among earlier rows, histories that extend the parent's ids."""
    n = draw(st.integers(1, 10))
    rows = []
    for i in range(n):
        parent = draw(st.integers(-1, i - 1))
        base = rows[parent]["hash_ids"][: draw(st.integers(0, len(rows[parent]["hash_ids"])))] if parent >= 0 else []
        ids = base + draw(st.lists(st.integers(0, 3), max_size=5))
        il = len(ids) * BS - (draw(st.integers(0, BS - 1)) if ids else 0)
        rows.append({"chat_id": 100 + i, "parent_chat_id": 100 + parent if parent >= 0 else -1,
                     "timestamp": float(i), "input_length": il, "output_length": draw(st.integers(0, 60)),
                     "type": "text", "turn": rows[parent]["turn"] + 1 if parent >= 0 else 1, "hash_ids": ids})
    return rows


@given(bailian_rows(), st.integers(2, 3))
@settings(max_examples=80, deadline=None)
def test_loader_matches_reference_on_generated_files(tmp_path_factory, rows, shared_min):
    path = tmp_path_factory.mktemp("gen") / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trace, _ = bailian.load(path, shared_min_sessions=shared_min)
    prefixes, root, types = ref_load(rows, shared_min)
    keys = trace.prompt_keys
    # Keys equal iff whole prefixes equal (content ids alone would over-share).
    same_prefix = np.array([[a == b for b in prefixes] for a in prefixes], dtype=bool).reshape(keys.size, keys.size)
    assert np.array_equal(keys[:, None] == keys[None, :], same_prefix)
    assert np.array_equal(trace.session[:, None] == trace.session[None, :],
                          np.equal.outer(np.array(root), np.array(root)))
    assert trace.prompt_types.tolist() == [int(x) for t in types for x in t]


def test_reference_agrees_on_the_excerpt(loaded, rows):
    _, _, types = ref_load(rows)
    assert loaded[0].prompt_types.tolist() == [int(x) for t in types for x in t]


# -- files written by the tests --------------------------------------------------------------------------------------


def _row(chat, parent=-1, t=0.0, turn=1, il=40, ol=20, ids=None, type_="text"):
    return {"chat_id": chat, "parent_chat_id": parent, "timestamp": t, "input_length": il, "output_length": ol,
            "type": type_, "turn": turn, "hash_ids": ids if ids is not None else [1, 2, 3]}


def _write(tmp_path, rows, name="t.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_missing_parent_starts_a_session_and_keeps_its_turn(tmp_path, rows):
    kept = [r for r in rows if r["chat_id"] != 555]
    trace, report = bailian.load(_write(tmp_path, kept))
    idx = _index(trace)
    assert trace.turn[idx[722]] == 2 and trace.app[idx[722]] == AppType.CHAT
    assert len({int(trace.session[idx[c]]) for c in (722, 816, 993)}) == 1
    assert int((trace.session == trace.session[idx[722]]).sum()) == 3
    assert trace.meta["parents_missing"] == 1
    assert any("1 requests whose parent is not in the file" in n for n in report.notes)
    # Without its parent, 722's history is no longer ASSISTANT-marked: it starts with the shared head.
    _, t722 = trace.prompt_blocks(idx[722])
    assert t722[0] == TokenType.SYSTEM and TokenType.ASSISTANT not in t722


def test_turn_mismatch_is_noted_not_rejected(tmp_path):
    path = _write(tmp_path, [_row(1), _row(2, parent=1, t=1.0, turn=5)])
    trace, report = bailian.load(path)
    assert trace.turn.tolist() == [1, 5] and trace.session.tolist() == [0, 0]
    assert any("1 requests whose turn is not their parent's + 1" in n for n in report.notes)


def test_out_of_order_rows_are_sorted(tmp_path):
    path = _write(tmp_path, [_row(2, parent=1, t=5.0, turn=2, ids=[1, 2, 4]), _row(1, t=1.0)])
    trace, report = bailian.load(path)
    assert trace.meta["chat_id"] == [1, 2] and trace.turn.tolist() == [1, 2]
    assert any("2 rows moved" in n for n in report.notes)


def test_unknown_request_type_is_kept_and_noted(tmp_path):
    trace, report = bailian.load(_write(tmp_path, [_row(1, type_="audio")]))
    assert trace.meta["request_type"] == ["audio"] and any("audio" in n for n in report.notes)


BAD = [
    ('{"chat_id": 3,', None, "malformed JSON"),
    ('"just a string"', None, "expected a JSON object"),
    ({k: v for k, v in _row(3).items() if k != "parent_chat_id"}, "parent_chat_id", "missing"),
    (_row(3, t=-1.0), "timestamp", ">= 0"),
    (_row(3, t="soon"), "timestamp", "must be a number"),
    (_row(3, t=float("nan")), "timestamp", "must be finite"),
    (_row(3, il=40.5), "input_length", "must be an integer"),
    (_row(3, turn="2"), "turn", "must be an integer"),
    (_row(3, turn=0), "turn", ">= 1"),
    (_row(3, parent=-2), "parent_chat_id", "must be -1"),
    (_row(3, parent=-(2**70)), "parent_chat_id", "must fit in 64 bits"),
    (_row(3, parent=3), "parent_chat_id", "own parent"),
    (_row(1), "chat_id", "duplicate chat_id 1"),
    (_row(3, parent=99), "parent_chat_id", "arrives after"),
    (_row(3, type_=7), "type", "must be a string"),
    (_row(3, ids=[1, 2]), "hash_ids", "has 2 ids but input_length=40 needs ceil"),
    (_row(3, ids=[1, None, 3]), "hash_ids", "element 1 must be an integer"),
    # issue 15: past the int32 turn column (it wrapped), past the token bound, true read as id 1, nested lists
    (_row(3, turn=2**63 - 1), "turn", "at most 2147483647"),
    (_row(3, turn=10**400), "turn", "at most 2147483647"),
    (_row(3, turn=1.5), "turn", "must be an integer"),
    (_row(3, il=10**9, ids=[1, 2, 3]), "input_length", "at most 100,000,000 tokens"),
    (_row(3, t=1e11), "timestamp", r"at most 1e\+10 s"),
    (_row(3, ids=[1, True, 3]), "hash_ids", "element 1 must be an integer, got True"),
    (_row(3, ids=[1, [2], 3]), "hash_ids", "element 1 must be an integer"),
    (_row(2**63), "chat_id", "< 2\\*\\*63"),
]


@pytest.mark.parametrize("bad,field,message", BAD)
def test_bad_row_names_file_line_and_field(tmp_path, bad, field, message):
    # Line 3 is the bad row; chat 99 (line 4) arrives later than everything, so it can be a late parent.
    path = _write(tmp_path, [_row(1, t=1.0), _row(2, t=2.0), bad, _row(99, t=50.0)])
    with pytest.raises(TraceFormatError, match=message) as exc:
        bailian.load(path)
    assert exc.value.line == 3 and exc.value.field == field and str(path) in str(exc.value)
    trace, report = bailian.load(path, on_error="skip")
    assert report.rows_read == 4 and report.rows_rejected == 1 and len(trace) == 3
    assert 3 not in trace.meta["chat_id"] or field == "chat_id"


def test_skip_counts_and_orphans(tmp_path):
    path = _write(tmp_path, [_row(1, t=1.0), "{", _row(2, parent=1, t=2.0, turn=2, ids=[1, 2]),
                             _row(3, parent=2, t=3.0, turn=3, ids=[1, 2, 3]), _row(3, t=4.0)])
    trace, report = bailian.load(path, on_error="skip")
    assert report.rejected == {"malformed JSON": 1, "hash_ids: length mismatch": 1, "chat_id: duplicate": 1}
    # Chat 3's parent (2) was rejected: 3 starts its own session and keeps turn 3.
    assert trace.meta["chat_id"] == [1, 3] and trace.turn.tolist() == [1, 3]
    assert trace.meta["parents_missing"] == 1 and trace.session.tolist() == [0, 1]


def test_empty_file_and_options(tmp_path):
    path = tmp_path / "e.jsonl"
    path.write_text("")
    with pytest.raises(TraceFormatError, match="empty file"):
        bailian.load(path)
    with pytest.raises(ValueError, match="unknown option"):
        bailian.load(BAILIAN, hub_min_successors=3)
    with pytest.raises(ValueError, match="shared_min_sessions"):
        bailian.load(BAILIAN, shared_min_sessions=0)
    trace, _ = bailian.load(BAILIAN, shared_min_sessions=10)
    # No key is used by 10 sessions in 22 rows: no shared head at all.
    assert not np.isin(trace.prompt_types, [TokenType.SYSTEM, TokenType.TEMPLATE]).any()
