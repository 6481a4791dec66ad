"""The session predictor: a ~1 M-parameter MLP that tells, at a session's first request, whether the session will
continue, and as chat or as agent (SAECache section 1; classes of :func:`sae_env.features.session_labels`).

Input: :func:`sae_env.features.request_features` of the first request = ``N_STRUCTURAL`` structural features
followed by a text block of ``text_dim`` (default 1536, the hidden size of Qwen2.5-1.5B, whose final hidden state
the paper feeds the predictor; our text block is a hashed n-gram projection of the prompt, see
:mod:`sae_env.features`). Traces without text (hash-only) get a zero text block, so one architecture serves every
trace; a model trained with no text at all ignores the text block at inference (``text_trained = False``), since its
text weights never saw data.

Model: ``Linear(in, 512) -> ReLU -> Linear(512, 256) -> ReLU -> Linear(256, 3)``; with ``in = 81 + 1536 = 1617``
that is 960,515 parameters. Inputs are normalised with statistics of the training split: structural columns are
z-scored (std floor 1e-6, then 1), the text block (already L2-normalised) is multiplied by ``sqrt(N_STRUCTURAL)`` so
both blocks have a norm of the same order.

Training (:meth:`SessionPredictor.fit`): cross-entropy, AdamW (lr 1e-3, weight decay 1e-4), mini-batches of 128
shuffled by a seeded ``torch.Generator``, a fixed number of epochs; ``torch.manual_seed(seed)``, one CPU thread and
``torch.use_deterministic_algorithms`` while fitting, so a seed gives bit-identical weights.

Evaluation (:func:`train_predictor`): held-out split by *session* (first requests are grouped by (trace, session)
and whole groups go to validation, seeded), accuracy, one-vs-rest AUC per class by the rank (Mann-Whitney) formula
with average ranks for ties, macro AUC over the classes present in both outcomes, the majority-class baseline (the
training split's majority class, scored on validation), and prediction throughput (requests/s at batch 1 and at
batch 256, model only, timed with ``time.perf_counter``; a wall-clock figure, never part of a metric).

Checkpoints (:meth:`SessionPredictor.save` / :meth:`SessionPredictor.load`): ``torch.save`` of a dict with the
``state_dict``, the normalisation ``mean`` / ``std`` tensors and a JSON ``config`` string; loaded with
``torch.load(path, weights_only=True)`` (no pickle).

Policies get the model as a callable (:meth:`SessionPredictor.as_policy_callable`): ``f(trace, i) -> (p_chat,
p_agent)`` with ``prepare(trace)``, which predicts every first request of a trace in one batch (features use only
what exists at each request's arrival, so batching up front changes nothing).

Why one piece (~540 lines): the model, its input normalisation, its training, its evaluation and its checkpoint are
one contract (a checkpoint records the feature version, the normalisation and the training report); its command
(``train.py predictor``) is the last few lines.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from sae_env.features import (
    CLASS_NAMES,
    DEFAULT_TEXT_DIM,
    FEATURE_VERSION,
    N_CLASSES,
    N_STRUCTURAL,
    request_features,
    session_labels,
)
from sae_env.files import atomic_path
from sae_env.trace import Trace

__all__ = ["PolicyPredictor", "SessionPredictor", "macro_auc", "one_vs_rest_auc", "train_predictor"]

CHECKPOINT_FORMAT = "saecache-session-predictor"
CHECKPOINT_VERSION = 1
DEFAULT_HIDDEN = (512, 256)


# ----------------------------------------------------------------------------------------------------------------
# Metrics


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks with ties sharing their average rank."""
    order = np.argsort(x, kind="stable")
    xs = x[order]
    n = x.size
    start = np.ones(n, dtype=bool)
    start[1:] = xs[1:] != xs[:-1]
    group = np.cumsum(start) - 1
    first = np.flatnonzero(start)
    last = np.append(first[1:], n) - 1
    avg = (first + last) / 2.0 + 1.0
    ranks = np.empty(n)
    ranks[order] = avg[group]
    return ranks


def one_vs_rest_auc(scores: np.ndarray, positive: np.ndarray) -> float:
    """ROC AUC of ``scores`` for the boolean ``positive`` (Mann-Whitney U / (n+ n-)); NaN if a side is empty."""
    scores = np.asarray(scores, dtype=np.float64)
    positive = np.asarray(positive, dtype=bool)
    n_pos = int(positive.sum())
    n_neg = positive.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    r = _average_ranks(scores)
    return float((r[positive].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def macro_auc(proba: np.ndarray, y: np.ndarray) -> tuple[float, list[float]]:
    """(macro AUC over the classes with both positives and negatives, per-class one-vs-rest AUC)."""
    per = [one_vs_rest_auc(proba[:, c], y == c) for c in range(proba.shape[1])]
    ok = [a for a in per if not math.isnan(a)]
    return (float(np.mean(ok)) if ok else float("nan")), per


# ----------------------------------------------------------------------------------------------------------------
# The model


def _mlp(in_dim: int, hidden: Sequence[int], n_out: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    d = in_dim
    for h in hidden:
        layers += [nn.Linear(d, h), nn.ReLU()]
        d = h
    layers.append(nn.Linear(d, n_out))
    return nn.Sequential(*layers)


class _OneThread:
    """One CPU thread (a small MLP runs faster on one: no contention), restored afterwards."""

    def __enter__(self) -> _OneThread:
        self.threads = torch.get_num_threads()
        if self.threads != 1:
            torch.set_num_threads(1)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.threads != 1:
            torch.set_num_threads(self.threads)


class _Deterministic(_OneThread):
    """One CPU thread and deterministic kernels while fitting; the process's settings come back afterwards."""

    def __enter__(self) -> _Deterministic:
        super().__enter__()
        self.det = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.use_deterministic_algorithms(self.det)
        super().__exit__(*exc)


class SessionPredictor:
    """The MLP with its input normalisation. ``predict_proba`` takes raw :func:`request_features` rows."""

    def __init__(self, text_dim: int = DEFAULT_TEXT_DIM, hidden: Sequence[int] = DEFAULT_HIDDEN,
                 n_structural: int = N_STRUCTURAL):
        if n_structural != N_STRUCTURAL:
            raise ValueError(f"this code computes {N_STRUCTURAL} structural features, the model expects "
                             f"{n_structural} (a checkpoint from another feature version?)")
        if isinstance(text_dim, bool) or not isinstance(text_dim, int) or text_dim < 0:
            raise ValueError(f"text_dim must be an integer >= 0, got {text_dim!r}")
        hidden = tuple(int(h) for h in hidden)
        if not hidden or min(hidden) < 1:
            raise ValueError(f"hidden sizes must be positive integers, got {hidden}")
        self.n_structural = n_structural
        self.text_dim = text_dim
        self.hidden = hidden
        self.in_dim = n_structural + text_dim
        self.text_trained = False
        self.model = _mlp(self.in_dim, hidden, N_CLASSES)
        self.mean = torch.zeros(self.in_dim)
        self.std = torch.ones(self.in_dim)
        self.history: list[float] = []
        self.device = torch.device("cpu")

    def to(self, device: str | torch.device) -> SessionPredictor:
        """Move the model and its normalisation to ``device`` (``auto``, ``cpu``, ``cuda``: :mod:`agents.device`)."""
        from agents.device import resolve_device

        self.device = resolve_device(device)
        self.model.to(self.device)
        self.mean, self.std = self.mean.to(self.device), self.std.to(self.device)
        return self

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    # -- inputs ----------------------------------------------------------------------------------------------
    def _pad(self, X: np.ndarray) -> np.ndarray:
        """Raw features -> the model's width: a missing text block becomes zeros (module docstring)."""
        X = np.asarray(X, dtype=np.float32)
        if X.ndim != 2:
            raise ValueError(f"features must be a 2-D array, got shape {X.shape}")
        if X.shape[1] == self.in_dim:
            out = X
        elif X.shape[1] == self.n_structural:
            out = np.zeros((X.shape[0], self.in_dim), dtype=np.float32)
            out[:, : self.n_structural] = X
        else:
            raise ValueError(f"features have {X.shape[1]} columns; the model takes {self.n_structural} structural "
                             f"+ {self.text_dim} text columns (or structural only)")
        if self.text_dim and not self.text_trained:
            out = out.copy() if out is X else out
            out[:, self.n_structural:] = 0.0
        if not np.isfinite(out).all():
            raise ValueError("features contain NaN or infinite values")
        return out

    def _normalise(self, X: np.ndarray) -> torch.Tensor:
        return (torch.from_numpy(X).to(self.device) - self.mean) / self.std

    # -- training --------------------------------------------------------------------------------------------
    def fit(self, X: np.ndarray, y: np.ndarray, seed: int = 0, epochs: int = 20, batch_size: int = 128,
            lr: float = 1e-3, weight_decay: float = 1e-4, device: str | torch.device | None = None) -> list[float]:
        """Train from scratch on raw features ``X`` and labels ``y`` (0/1/2); returns the mean loss per epoch.

        ``device`` (default: the predictor's, the CPU unless moved with :meth:`to`): where it trains; the weights
        start from the same seeded CPU initialisation and batches come in the same seeded order on every device.
        """
        X = np.asarray(X, dtype=np.float32)
        y = np.asarray(y, dtype=np.int64).ravel()
        if X.ndim != 2 or X.shape[0] != y.size or y.size == 0:
            raise ValueError(f"need one label per feature row and at least one row, got X {X.shape}, y {y.shape}")
        if y.min() < 0 or y.max() >= N_CLASSES:
            raise ValueError(f"labels must lie in 0..{N_CLASSES - 1}")
        if int(epochs) < 1 or int(batch_size) < 1:
            raise ValueError("epochs and batch_size must be >= 1")
        self.text_trained = bool(self.text_dim) and X.shape[1] == self.in_dim and bool(np.any(X[:, N_STRUCTURAL:]))
        Xp = self._pad(X)
        s = self.n_structural
        mean = np.zeros(self.in_dim, dtype=np.float32)
        std = np.ones(self.in_dim, dtype=np.float32)
        mean[:s] = Xp[:, :s].mean(axis=0)
        sd = Xp[:, :s].std(axis=0)
        std[:s] = np.where(sd > 1e-6, sd, 1.0)
        std[s:] = 1.0 / math.sqrt(s)  # text block x sqrt(n_structural)
        with _Deterministic():
            torch.manual_seed(int(seed))
            self.model = _mlp(self.in_dim, self.hidden, N_CLASSES)
            self.mean, self.std = torch.from_numpy(mean), torch.from_numpy(std)
            self.to(self.device if device is None else device)
            xt = self._normalise(Xp)
            yt = torch.from_numpy(y).to(self.device)
            gen = torch.Generator().manual_seed(int(seed))
            opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay)
            loss_fn = nn.CrossEntropyLoss()
            self.model.train()
            self.history = []
            n = y.size
            for _ in range(int(epochs)):
                perm = torch.randperm(n, generator=gen).to(self.device)
                total = 0.0
                for a in range(0, n, int(batch_size)):
                    b = perm[a:a + int(batch_size)]
                    opt.zero_grad()
                    loss = loss_fn(self.model(xt[b]), yt[b])
                    loss.backward()
                    opt.step()
                    total += loss.detach().item() * b.numel()
                self.history.append(total / n)
            self.model.eval()
        return list(self.history)

    def loss(self, X: np.ndarray, y: np.ndarray) -> float:
        """Mean cross-entropy on raw features."""
        p = self.predict_proba(X)
        y = np.asarray(y, dtype=np.int64)
        return float(-np.mean(np.log(np.clip(p[np.arange(y.size), y], 1e-12, 1.0))))

    # -- inference -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def predict_proba(self, X: np.ndarray, batch_size: int = 4096) -> np.ndarray:
        """Class probabilities ``[n, 3]`` (none, chat, agent) for raw feature rows."""
        Xp = self._pad(X)
        if self.model.training:  # eval() walks every module: not on each call
            self.model.eval()
        out = np.empty((Xp.shape[0], N_CLASSES), dtype=np.float64)
        with _OneThread():
            for a in range(0, Xp.shape[0], batch_size):
                logits = self.model(self._normalise(Xp[a:a + batch_size]))
                out[a:a + batch_size] = torch.softmax(logits, dim=1).cpu().numpy()
        return out

    def predict_trace(self, trace: Trace, idx: Sequence[int] | np.ndarray) -> np.ndarray:
        """Probabilities for the requests ``idx`` of ``trace`` (features computed here)."""
        return self.predict_proba(request_features(trace, idx))

    def as_policy_callable(self) -> PolicyPredictor:
        """The adapter policies call: ``f(trace, i) -> (p_chat, p_agent)``, with ``prepare(trace)``."""
        return PolicyPredictor(self)

    # -- persistence -----------------------------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        return {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "feature_version": FEATURE_VERSION,
                "n_structural": self.n_structural, "text_dim": self.text_dim, "hidden": list(self.hidden),
                "classes": list(CLASS_NAMES), "text_trained": self.text_trained}

    def save(self, path: str | os.PathLike) -> Path:
        """Write the checkpoint atomically (temp file + rename)."""
        path = Path(path)
        with atomic_path(path) as tmp:
            torch.save({"config": json.dumps(self.config()),
                        "state_dict": {k: v.cpu() for k, v in self.model.state_dict().items()},
                        "mean": self.mean.cpu().clone(), "std": self.std.cpu().clone()}, tmp)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, device: str | torch.device = "cpu") -> SessionPredictor:
        """Read a checkpoint written by :meth:`save` (``weights_only=True``: no arbitrary objects) onto ``device``."""
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such checkpoint")
        try:
            blob = torch.load(path, weights_only=True, map_location="cpu")
            cfg = json.loads(blob["config"])
        except Exception as e:  # noqa: BLE001 - torch.load / json raise many kinds
            raise ValueError(f"{path}: not a session-predictor checkpoint ({e})") from e
        if not isinstance(cfg, dict) or cfg.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"{path}: not a session-predictor checkpoint (format {cfg.get('format')!r})")
        if cfg.get("feature_version") != FEATURE_VERSION:
            raise ValueError(f"{path}: features version {cfg.get('feature_version')}, this code computes version "
                             f"{FEATURE_VERSION}; retrain the predictor")
        p = cls(text_dim=int(cfg["text_dim"]), hidden=cfg["hidden"], n_structural=int(cfg["n_structural"]))
        p.text_trained = bool(cfg.get("text_trained", False))
        try:
            p.model.load_state_dict(blob["state_dict"])
        except RuntimeError as e:
            raise ValueError(f"{path}: weights do not fit the configured model ({e})") from e
        p.mean, p.std = blob["mean"].float(), blob["std"].float()
        if p.mean.shape != (p.in_dim,) or p.std.shape != (p.in_dim,):
            raise ValueError(f"{path}: normalisation statistics have the wrong shape")
        p.model.eval()
        return p.to(device)


class PolicyPredictor:
    """``f(trace, i) -> (p_continue_chat, p_continue_agent)`` for policies, batch-predicted per trace.

    :meth:`prepare` predicts every ``turn == 1`` request of the trace in one batch; a call for a request that was
    not prepared (another trace, a later turn) computes its features on the spot, from the requests up to it.
    """

    def __init__(self, predictor: SessionPredictor):
        self.predictor = predictor
        self._trace: Trace | None = None
        self._chat: list[float] = []  # per request; NaN = not predicted yet (plain lists: a call is on a hot path)
        self._agent: list[float] = []

    def prepare(self, trace: Trace) -> None:
        idx = np.flatnonzero(trace.turn == 1)
        p = np.full((len(trace), 2), np.nan)
        if idx.size:
            p[idx] = self.predictor.predict_trace(trace, idx)[:, 1:]
        self._trace, self._chat, self._agent = trace, p[:, 0].tolist(), p[:, 1].tolist()

    def __call__(self, trace: Trace, i: int) -> tuple[float, float]:
        if trace is not self._trace:
            self.prepare(trace)
        pc = self._chat[i]
        if pc != pc:  # NaN: not prepared (a later turn)
            row = self.predictor.predict_proba(request_features(trace[: i + 1], [i]))[0]
            pc = self._chat[i] = float(row[1])
            self._agent[i] = float(row[2])
        return pc, self._agent[i]


# ----------------------------------------------------------------------------------------------------------------
# Training entry point


@dataclass
class _Dataset:
    X: np.ndarray
    y: np.ndarray
    group: np.ndarray  # (trace, session) group id per row


def _dataset(traces: Sequence[Trace], text_dim: int) -> _Dataset:
    xs, ys, gs = [], [], []
    base = 0
    for tr in traces:
        idx, y = session_labels(tr)
        X = request_features(tr, idx)
        if X.shape[1] not in (N_STRUCTURAL, N_STRUCTURAL + text_dim):
            raise ValueError(f"trace {tr!r} has {X.shape[1] - N_STRUCTURAL} text features, the predictor takes "
                             f"{text_dim}; load it with feature_dim={text_dim}")
        if X.shape[1] == N_STRUCTURAL and text_dim:
            X = np.concatenate([X, np.zeros((X.shape[0], text_dim), dtype=np.float32)], axis=1)
        sid = tr.session_ids()[idx]
        _, g = np.unique(sid, return_inverse=True)
        xs.append(X)
        ys.append(y)
        gs.append(g.astype(np.int64) + base)
        base += int(g.max()) + 1 if g.size else 0
    return _Dataset(np.concatenate(xs), np.concatenate(ys), np.concatenate(gs))


def _throughput(pred: SessionPredictor, X: np.ndarray, batch: int, min_s: float = 0.3) -> float:
    """Requests per second of predict_proba at a given batch size (wall clock)."""
    rows = X[np.arange(batch) % X.shape[0]]
    pred.predict_proba(rows)  # warm-up
    n = 0
    t0 = time.perf_counter()
    while True:
        pred.predict_proba(rows)
        n += rows.shape[0]
        dt = time.perf_counter() - t0
        if dt >= min_s:
            return n / dt


def train_predictor(traces: Sequence[Trace], out: str | os.PathLike | None, seed: int = 0,
                    val_fraction: float = 0.2, epochs: int = 20, text_dim: int | None = None,
                    batch_size: int = 128, lr: float = 1e-3, measure_throughput: bool = True,
                    device: str = "cpu") -> dict[str, Any]:
    """Train on the first requests of ``traces``, evaluate on held-out sessions, write the checkpoint to ``out``.
    ``device``: where it trains and predicts (``auto``, ``cpu``, ``cuda``; :mod:`agents.device`).

    ``text_dim``: width of the text block (default: the traces' text width, else 1536). Returns a JSON-able report
    (module docstring); the checkpoint is trained on the training split only (the reported figures are its own).
    """
    if not traces:
        raise ValueError("train_predictor needs at least one trace")
    if not 0.0 < float(val_fraction) < 1.0:
        raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    widths = {tr.features.shape[1] for tr in traces if tr.features is not None}
    if text_dim is None:
        if len(widths) > 1:
            raise ValueError(f"the traces have text features of different widths {sorted(widths)}")
        text_dim = widths.pop() if widths else DEFAULT_TEXT_DIM
    data = _dataset(traces, int(text_dim))
    if data.y.size < 2:
        raise ValueError(f"the traces hold {data.y.size} first request(s); need at least 2 sessions to train")
    rng = np.random.default_rng(int(seed))
    groups = np.unique(data.group)
    n_val = min(max(1, int(round(val_fraction * groups.size))), groups.size - 1)
    val_groups = rng.permutation(groups)[:n_val]
    is_val = np.isin(data.group, val_groups)
    tr_i, va_i = np.flatnonzero(~is_val), np.flatnonzero(is_val)
    if np.intersect1d(data.group[tr_i], data.group[va_i]).size:
        raise RuntimeError("a session is in both the training and the validation split")
    pred = SessionPredictor(text_dim=int(text_dim))
    Xtr, ytr, Xva, yva = data.X[tr_i], data.y[tr_i], data.X[va_i], data.y[va_i]
    t0 = time.perf_counter()
    history = pred.fit(Xtr, ytr, seed=seed, epochs=epochs, batch_size=batch_size, lr=lr, device=device)
    train_s = time.perf_counter() - t0
    proba = pred.predict_proba(Xva)
    majority = int(np.bincount(ytr, minlength=N_CLASSES).argmax())
    auc, per_class = macro_auc(proba, yva)
    # the loss before training: the same seeded initial weights and normalisation that fit() started from
    init = SessionPredictor(text_dim=int(text_dim))
    init.text_trained = pred.text_trained
    init.mean, init.std = pred.mean.cpu(), pred.std.cpu()
    with _Deterministic():
        torch.manual_seed(int(seed))
        init.model = _mlp(init.in_dim, init.hidden, N_CLASSES)
    init_loss = init.loss(Xtr, ytr)
    report: dict[str, Any] = {
        "n_traces": len(traces), "n_sessions": int(groups.size), "n_train": int(tr_i.size), "n_val": int(va_i.size),
        "class_counts_train": np.bincount(ytr, minlength=N_CLASSES).tolist(),
        "class_counts_val": np.bincount(yva, minlength=N_CLASSES).tolist(), "classes": list(CLASS_NAMES),
        "n_params": pred.n_params, "in_dim": pred.in_dim, "text_dim": pred.text_dim,
        "text_trained": pred.text_trained, "seed": int(seed), "epochs": int(epochs),
        "train_loss_initial": init_loss, "train_loss_final": pred.loss(Xtr, ytr), "loss_history": history,
        "val_loss": pred.loss(Xva, yva), "val_accuracy": float(np.mean(proba.argmax(axis=1) == yva)),
        "val_majority_class": majority, "val_majority_accuracy": float(np.mean(yva == majority)),
        "val_macro_auc": auc, "val_auc_per_class": per_class, "train_seconds": train_s,
        "device": str(pred.device),
    }
    if measure_throughput:
        pool = data.X if data.X.shape[0] else np.zeros((1, pred.in_dim), np.float32)
        report["throughput_batch1_rps"] = _throughput(pred, pool, 1)
        report["throughput_batch256_rps"] = _throughput(pred, pool, 256)
    if out is not None:
        report["checkpoint"] = str(pred.save(out))
    return report


def format_report(report: dict[str, Any]) -> str:
    def f(v: Any) -> str:
        return f"{v:.4f}" if isinstance(v, float) else str(v)

    keys = ("n_traces", "n_sessions", "n_train", "n_val", "class_counts_train", "class_counts_val", "n_params",
            "in_dim", "text_trained", "epochs", "train_loss_initial", "train_loss_final", "val_loss",
            "val_accuracy", "val_majority_accuracy", "val_macro_auc", "val_auc_per_class",
            "throughput_batch1_rps", "throughput_batch256_rps", "train_seconds", "checkpoint")
    lines = []
    for k in keys:
        if k in report:
            v = report[k]
            v = "[" + ", ".join(f(x) for x in v) + "]" if isinstance(v, list) else f(v)
            lines.append(f"{k:>24}  {v}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# Command line


def track_report(report: dict[str, Any], out: Path, mode: str | None = None) -> None:
    """A W&B run (job type ``predictor``) of a training report: ``losses/train_loss`` per epoch, then the held-out
    ``losses/val_loss`` and ``charts/val_accuracy`` / ``charts/val_macro_auc`` / ``charts/val_majority_accuracy``,
    stepped on ``epoch``; the report's numbers in its summary. ``mode``, else W&B's variables, else offline, under
    ``<checkpoint folder>/wandb``."""
    from sae_env.tracking import TrainingRun, resolve_target

    config = {k: v for k, v in report.items() if k not in ("loss_history", "checkpoint")}
    run = TrainingRun(resolve_target(mode, default_dir=out.parent), name=out.stem, job_type="predictor",
                      config=config, step_metric="epoch", log=lambda msg: print(msg, file=sys.stderr))
    try:
        history = report["loss_history"]
        for epoch, loss in enumerate(history, 1):
            row: dict[str, Any] = {"epoch": epoch, "losses/train_loss": loss}
            if epoch == len(history):
                row.update({"losses/val_loss": report["val_loss"], "charts/val_accuracy": report["val_accuracy"],
                            "charts/val_macro_auc": report["val_macro_auc"],
                            "charts/val_majority_accuracy": report["val_majority_accuracy"]})
            run.log(row)
        run.summarize(report)
    finally:
        run.finish()


def cmd_predictor(args: argparse.Namespace) -> int:
    from sae_env.cli import load_input, parse_options, write_json
    from sae_env.files import check_output_file

    check_output_file(args.out, "--out")  # before the training, not after it
    traces = []
    for name in args.train:
        trace, rep = load_input(name, args.source, parse_options(args.opt))
        print(rep, file=sys.stderr)
        traces.append(trace)
    report = train_predictor(traces, args.out, seed=args.seed, val_fraction=args.val_fraction, epochs=args.epochs,
                             device=args.device)
    track_report(report, Path(args.out), "disabled" if args.no_wandb else args.wandb)
    print(format_report(report))
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
