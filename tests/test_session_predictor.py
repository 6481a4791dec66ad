"""Tests of agents.session_predictor: size, learning, determinism, checkpoints, metrics, the policy adapter, CLI.

* Learning: on a synthetic workload (templated vs chat vs agent first requests differ structurally) and on a text
  workload whose continuation depends only on the words of the first user message (structure carries no signal:
  the text-less model must stay near chance while the text model separates the classes).
* AUC against the pairwise definition (hypothesis, with ties).
"""

from __future__ import annotations

import argparse
import json
from itertools import product

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agents.session_predictor import (
    PolicyPredictor,
    SessionPredictor,
    macro_auc,
    one_vs_rest_auc,
    train_predictor,
)
from sae_env.features import N_STRUCTURAL, first_requests, request_features, session_labels
from sae_env.sources import load_source


@pytest.fixture(scope="module")
def synthetic():
    tr, _ = load_source("synthetic", None, seed=5, phases=[{"duration": 700, "rate": 1.0,
                                                            "mix": {"templated": 0.4, "chat": 0.35, "agent": 0.25}}])
    return tr


@pytest.fixture(scope="module")
def trained(synthetic, tmp_path_factory):
    out = tmp_path_factory.mktemp("sp") / "predictor.pt"
    report = train_predictor([synthetic], out, seed=0, epochs=12, measure_throughput=False)
    return report, out


def test_parameter_count():
    p = SessionPredictor()
    assert p.n_params == 960_515  # (81 + 1536) * 512 + 512 + 512 * 256 + 256 + 256 * 3 + 3
    assert 0.8e6 <= p.n_params <= 1.3e6
    assert p.in_dim == N_STRUCTURAL + 1536


def test_learns_synthetic_workload(trained, synthetic):
    report, out = trained
    assert report["n_train"] + report["n_val"] == first_requests(synthetic).size
    assert report["train_loss_final"] < 0.6 * report["train_loss_initial"]
    assert report["train_loss_initial"] == pytest.approx(np.log(3), abs=0.15)  # untrained: near uniform
    assert report["loss_history"][-1] < report["loss_history"][0]
    assert report["val_accuracy"] > report["val_majority_accuracy"] + 0.15
    assert report["val_macro_auc"] > 0.85
    assert report["text_trained"] is False
    assert out.exists() and report["checkpoint"] == str(out)
    json.dumps(report)  # JSON-able


def _topic_conversations(n: int, seed: int) -> list[dict]:
    """Continuation depends only on the topic words of the first user message; lengths are drawn alike."""
    rng = np.random.default_rng(seed)
    # words of at most 6 letters are one token each for the simple tokenizer: prompt lengths carry no signal
    once = "spell define sum count cite quote date time unit rate".split()
    multi = "story plan essay debug design novel tutor draft poem idea".split()
    rows = []
    for c in range(n):
        cont = c % 2 == 1
        vocab = multi if cont else once
        words = " ".join(rng.choice(vocab, size=rng.integers(8, 16)))
        msgs = [{"role": "user", "content": f"please {words}"}, {"role": "assistant", "content": "ok " * 20}]
        if cont:
            msgs += [{"role": "user", "content": "more " * int(rng.integers(3, 9))},
                     {"role": "assistant", "content": "sure " * 20}]
        rows.append({"messages": msgs})
    return rows


def test_text_features_carry_the_signal(tmp_path):
    path = tmp_path / "topics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _topic_conversations(240, seed=1)))
    text, _ = load_source("conversations", path, features="ngram")
    with_text = train_predictor([text], None, seed=0, epochs=15, measure_throughput=False)
    assert with_text["text_trained"] is True
    assert with_text["val_accuracy"] >= 0.9
    assert with_text["val_macro_auc"] >= 0.95
    text.features = None
    without = train_predictor([text], None, seed=0, epochs=15, measure_throughput=False)
    assert without["text_trained"] is False
    assert without["val_accuracy"] <= 0.75


def test_fit_is_deterministic_and_seeded(synthetic):
    idx, y = session_labels(synthetic)
    X = request_features(synthetic, idx)
    a, b, c = SessionPredictor(), SessionPredictor(), SessionPredictor()
    ha = a.fit(X, y, seed=3, epochs=2)
    hb = b.fit(X, y, seed=3, epochs=2)
    c.fit(X, y, seed=4, epochs=2)
    assert ha == hb
    for (k, va), vb in zip(a.model.state_dict().items(), b.model.state_dict().values(), strict=True):
        assert torch.equal(va, vb), k
    assert any(not torch.equal(va, vc) for va, vc in zip(a.model.state_dict().values(),
                                                          c.model.state_dict().values(), strict=True))
    assert torch.get_num_threads() >= 1 and not torch.are_deterministic_algorithms_enabled()  # settings restored
    with pytest.raises(ValueError, match="labels"):
        a.fit(X, y + 3, epochs=1)
    with pytest.raises(ValueError, match="columns"):
        a.predict_proba(X[:, :10])


def test_checkpoint_round_trip(trained, synthetic, tmp_path):
    _, out = trained
    p = SessionPredictor.load(out)
    blob = torch.load(out, weights_only=True)  # plain tensors and a JSON string: no pickled objects
    assert set(blob) == {"config", "state_dict", "mean", "std"}
    cfg = json.loads(blob["config"])
    assert cfg["text_dim"] == 1536 and cfg["hidden"] == [512, 256] and cfg["text_trained"] is False
    idx = first_requests(synthetic)
    X = request_features(synthetic, idx)
    proba = p.predict_proba(X)
    assert proba.shape == (idx.size, 3)
    np.testing.assert_allclose(proba.sum(axis=1), 1.0, atol=1e-6)
    again = SessionPredictor.load(p.save(tmp_path / "again.pt")).predict_proba(X)
    np.testing.assert_array_equal(proba, again)
    # a structural-only model ignores a text block it never saw
    padded = np.concatenate([X, np.random.default_rng(0).random((X.shape[0], 1536), dtype=np.float32)], axis=1)
    np.testing.assert_array_equal(p.predict_proba(padded), proba)


def test_bad_checkpoints(tmp_path, trained):
    _, out = trained
    with pytest.raises(FileNotFoundError):
        SessionPredictor.load(tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a session-predictor checkpoint"):
        SessionPredictor.load(tmp_path / "junk.pt")
    torch.save({"config": json.dumps({"format": "other"})}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="format"):
        SessionPredictor.load(tmp_path / "other.pt")
    blob = torch.load(out, weights_only=True)
    cfg = json.loads(blob["config"])
    cfg["feature_version"] = -1
    blob["config"] = json.dumps(cfg)
    torch.save(blob, tmp_path / "old.pt")
    with pytest.raises(ValueError, match="retrain"):
        SessionPredictor.load(tmp_path / "old.pt")

    torch.save({"config": argparse.Namespace(x=1)}, tmp_path / "evil.pt")  # a pickled object, not a tensor
    with pytest.raises(ValueError, match="not a session-predictor checkpoint"):
        SessionPredictor.load(tmp_path / "evil.pt")  # weights_only refuses arbitrary objects


def _auc_pairs(scores, pos):
    p, n = scores[pos], scores[~pos]
    if p.size == 0 or n.size == 0:
        return float("nan")
    wins = sum(1.0 if a > b else 0.5 if a == b else 0.0 for a, b in product(p, n))
    return wins / (p.size * n.size)


@settings(max_examples=100, deadline=None)
@given(data=st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=1, max_size=30))
def test_auc_matches_pairwise_definition(data):
    scores = np.array([d[0] for d in data], dtype=float)
    pos = np.array([d[1] for d in data])
    got, ref = one_vs_rest_auc(scores, pos), _auc_pairs(scores, pos)
    assert (np.isnan(got) and np.isnan(ref)) or got == pytest.approx(ref)


def test_macro_auc_skips_absent_classes():
    proba = np.array([[0.8, 0.2, 0.0], [0.3, 0.7, 0.0], [0.6, 0.4, 0.0]])
    auc, per = macro_auc(proba, np.array([0, 1, 0]))
    assert per[0] == 1.0 and per[1] == 1.0 and np.isnan(per[2]) and auc == 1.0


def test_policy_callable(trained, synthetic):
    _, out = trained
    p = SessionPredictor.load(out)
    f = p.as_policy_callable()
    assert isinstance(f, PolicyPredictor)
    f.prepare(synthetic)
    idx = np.flatnonzero(synthetic.turn == 1)
    proba = p.predict_proba(request_features(synthetic, idx))
    for n in range(0, idx.size, max(1, idx.size // 20)):
        assert f(synthetic, int(idx[n])) == pytest.approx(tuple(proba[n, 1:]))
    later = int(np.flatnonzero(synthetic.turn > 1)[0])  # not prepared: computed from the requests up to it
    got = f(synthetic, later)
    assert got == pytest.approx(tuple(p.predict_proba(request_features(synthetic, [later]))[0, 1:]))
    other = synthetic[:50]
    assert f(other, 0) == pytest.approx(tuple(p.predict_proba(request_features(other, [0]))[0, 1:]))


def test_throughput_is_reported(synthetic):
    report = train_predictor([synthetic[:400]], None, seed=0, epochs=1)
    assert report["throughput_batch1_rps"] > 0 and report["throughput_batch256_rps"] > 0


def test_bad_arguments(synthetic):
    with pytest.raises(ValueError, match="at least one trace"):
        train_predictor([], None)
    with pytest.raises(ValueError, match="val_fraction"):
        train_predictor([synthetic], None, val_fraction=1.0)
    with pytest.raises(ValueError, match="need at least 2 sessions"):
        train_predictor([synthetic[:1]], None)


def test_cli(tmp_path, synthetic):
    from agents.cli import add_predictor_command

    trace_path = synthetic[:600].save(tmp_path / "syn.npz")
    parser = argparse.ArgumentParser()
    add_predictor_command(parser.add_subparsers(dest="command"))
    out, rep = tmp_path / "p.pt", tmp_path / "report.json"
    args = parser.parse_args(["predictor", "--train", str(trace_path), str(trace_path), "--out", str(out),
                              "--epochs", "2", "--seed", "1", "--json", str(rep)])
    assert args.func(args) == 0
    assert SessionPredictor.load(out).n_params == 960_515
    report = json.loads(rep.read_text())
    assert report["n_traces"] == 2 and report["seed"] == 1 and report["epochs"] == 2
