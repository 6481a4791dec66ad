"""Workload characterisation of a :class:`~sae_env.trace.Trace`: the paper's reuse-by-type / app / offset study and
the inter-turn gap fits, as one JSON-able dict, an aligned text table and PNG figures.

Definitions
-----------
- An "occurrence" of a block key is either a prompt block reference of request i or an output block of request i
  (output blocks become cacheable after decode of request i, i.e. they are available to requests after i).
- ``block_refs`` = number of prompt block references; ``distinct_blocks`` = distinct keys among prompt and output
  blocks. Top-level ``reuse_ratio`` = the infinite-cache block hit ratio: the fraction of prompt block references
  whose key occurred earlier (in an earlier request's prompt or output blocks). "Earlier" is defined strictly by
  request order (request j < i), and a key that occurs twice in the same request counts once-first (the earliest
  occurrence is used): a repeat inside one request is not a hit.
- Per TokenType and per AppType: ``block_refs`` = number of occurrences (prompt refs + output blocks) of that type,
  ``reuse_ratio`` = forward reuse: fraction of those occurrences whose key is referenced again by the prompt of a
  LATER request (output blocks count, so REASONING, which appears only as output, gets a ratio), plus
  ``hit_ratio`` (backward, prompt refs only; null when the type has no prompt refs) and ``reuses_per_block`` (later
  prompt references per distinct key of that type: for each distinct key with at least one occurrence of the type,
  the number of prompt references to that key, of any type, in requests after the first request where the key
  occurs with that type; summed and divided by the number of such keys). Types come from the occurrence's type
  array (the app of an occurrence is its request's app); for a key with different types in different places each
  occurrence's own type is used. Only types / apps that occur are listed.
- By block offset (position j of a block in its prompt; prompt references only): hit ratio (backward) per offset
  bucket and forward reuse per bucket. Buckets are log2: 0, 1, 2-3, 4-7, ... (bucket b >= 1 holds
  ``2**(b-1) <= j < 2**b``).
- Intra- vs cross-session reuse: of prompt references that are hits, the fraction whose previous occurrence (the
  most recent earlier request in which the key occurs) was in the same session (intra) vs a different session
  (cross). Sessions are ``trace.session_ids()`` (unknown sessions are unique per request). Null when there is no hit.
- LRU-to-Belady headroom (:func:`headroom`, not part of :func:`characterize`: it replays the trace): the token
  hit rates of LRU and of Belady's offline bound at cache sizes given as fractions of the distinct blocks (default
  5 / 10 / 20 %, sized as experiments size them, :func:`sae_env.cache.resolve_capacity`), instant serving, and
  their difference in percentage points: what any online policy can gain over LRU at that size.
- Inter-turn gaps per AppType: gaps between consecutive requests of the same session (``t[k+1] - t[k]``, requests
  sorted by time, ties by trace order); a gap belongs to the app of its later request. Only positive gaps are
  fitted; zero gaps are counted separately (``zero_gaps``). Fits are maximum likelihood: log-normal
  (``mu`` = mean ln gap, ``sigma`` = std ln gap with ddof=0) and exponential (``rate`` = 1 / mean gap), with
  goodness of fit: the KS statistic of each (``scipy.stats.kstest``) and the total log-likelihood of each;
  ``better`` names the fit with the higher log-likelihood. Only apps with >= 2 positive gaps get a fit (fields are
  null otherwise); a log-normal with ``sigma == 0`` (all gaps equal) is degenerate, its KS / log-likelihood are
  null and ``better`` is null.

Algorithm
---------
All occurrences are laid out in one stream ordered by (request, prompt before output, position). A stable argsort
of the stream's keys groups each key's occurrences in stream order, hence in request order. Within a key group,
a "run" is the occurrences of one request. Then, for an occurrence at sorted position p:

- backward hit  <=> its run does not start its key group (an earlier request holds the key); the previous
  occurrence is the element just before its run;
- forward reuse <=> some prompt occurrence lies after its run within the group (prefix sums of the prompt flag).

Everything is a few sorts and prefix sums over flat arrays: no Python object per block.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from sae_env.trace import N_APP_TYPES, N_TOKEN_TYPES, AppType, TokenType, Trace, csr_offsets

__all__ = ["HEADROOM_FRACTIONS", "characterize", "format_headroom", "format_table", "headroom", "offset_bucket",
           "session_gaps", "write_plots"]

HEADROOM_FRACTIONS = (0.05, 0.1, 0.2)


def offset_bucket(pos: np.ndarray) -> np.ndarray:
    """Log2 bucket of block offsets: 0 -> 0, 1 -> 1, 2-3 -> 2, 4-7 -> 3, ..."""
    pos = np.asarray(pos, dtype=np.int64)
    out = np.zeros(pos.shape, dtype=np.int64)
    nz = pos > 0
    # floor(log2 j) + 1 is frexp's exponent; exact as long as offsets stay below 2**53.
    out[nz] = np.frexp(pos[nz].astype(np.float64))[1]
    return out


def _bucket_label(b: int) -> tuple[str, int, int]:
    if b == 0:
        return "0", 0, 0
    lo, hi = 1 << (b - 1), (1 << b) - 1
    return (str(lo) if lo == hi else f"{lo}-{hi}"), lo, hi


def _ratio(num: float, den: float) -> float | None:
    return float(num) / float(den) if den else None


def _n_distinct(a: np.ndarray) -> int:
    a = np.sort(a)
    return int(a.size and 1 + (a[1:] != a[:-1]).sum())


def _run_bounds(flags_new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For a boolean "starts a new run" array (flags_new[0] must be True): each element's run start and run end."""
    n = flags_new.size
    idx = np.arange(n, dtype=np.int64)
    start = np.maximum.accumulate(np.where(flags_new, idx, 0))
    starts = np.flatnonzero(flags_new)
    ends = np.empty_like(starts)
    ends[:-1] = starts[1:] - 1
    if ends.size:
        ends[-1] = n - 1
    run_id = np.cumsum(flags_new) - 1
    return start, ends[run_id]


def _occurrence_stream(trace: Trace) -> dict[str, np.ndarray]:
    """Prompt and output blocks of every request interleaved in (request, prompt before output, position) order."""
    n_req = len(trace)
    p_len = np.diff(trace.prompt_offsets)
    o_len = np.diff(trace.output_offsets)
    start = csr_offsets(p_len + o_len)[:-1]
    req_p = np.repeat(np.arange(n_req, dtype=np.int64), p_len)
    req_o = np.repeat(np.arange(n_req, dtype=np.int64), o_len)
    pos_p = np.arange(trace.n_blocks, dtype=np.int64) - trace.prompt_offsets[req_p]
    pos_o = np.arange(trace.n_output_blocks, dtype=np.int64) - trace.output_offsets[req_o]
    at_p = start[req_p] + pos_p
    at_o = start[req_o] + p_len[req_o] + pos_o
    total = trace.n_blocks + trace.n_output_blocks
    key = np.empty(total, dtype=np.int64)
    req = np.empty(total, dtype=np.int64)
    typ = np.empty(total, dtype=np.int8)
    pos = np.full(total, -1, dtype=np.int64)  # prompt offset; -1 for output blocks
    key[at_p], key[at_o] = trace.prompt_keys, trace.output_keys
    req[at_p], req[at_o] = req_p, req_o
    typ[at_p], typ[at_o] = trace.prompt_types, trace.output_types
    pos[at_p] = pos_p
    return {"key": key, "req": req, "type": typ, "pos": pos}


def _group_stats(labels: np.ndarray, n_labels: int, names: Sequence[str], is_prompt: np.ndarray, hit: np.ndarray,
                 fwd: np.ndarray, group_id: np.ndarray, later_prompt: np.ndarray) -> dict[str, dict[str, Any]]:
    """Per-label summary; all arrays are in key-sorted order. ``labels`` is a type or app per occurrence."""
    labels = labels.astype(np.int64)
    refs = np.bincount(labels, minlength=n_labels)
    fwd_n = np.bincount(labels, weights=fwd, minlength=n_labels)
    p_refs = np.bincount(labels[is_prompt], minlength=n_labels)
    p_hits = np.bincount(labels[is_prompt], weights=hit[is_prompt], minlength=n_labels)
    # First occurrence of each (key, label) pair, one label at a time: among the occurrences carrying label v
    # (still in key-group, then stream order) the first of each group. O(n) per label, cheaper than a sort.
    first_parts = []
    for v in range(n_labels):
        idx = np.flatnonzero(labels == v)
        if idx.size:
            g = group_id[idx]
            new = np.ones(idx.size, dtype=bool)
            np.not_equal(g[1:], g[:-1], out=new[1:])
            first_parts.append(idx[new])
    first = np.concatenate(first_parts) if first_parts else np.zeros(0, dtype=np.int64)
    n_keys = np.bincount(labels[first], minlength=n_labels)
    later = np.bincount(labels[first], weights=later_prompt[first], minlength=n_labels)
    out: dict[str, dict[str, Any]] = {}
    for v in range(n_labels):
        if refs[v] == 0:
            continue
        out[names[v]] = {
            "block_refs": int(refs[v]),
            "prompt_refs": int(p_refs[v]),
            "distinct_blocks": int(n_keys[v]),
            "reuse_ratio": _ratio(fwd_n[v], refs[v]),
            "hit_ratio": _ratio(p_hits[v], p_refs[v]),
            "reuses_per_block": _ratio(later[v], n_keys[v]),
        }
    return out


def session_gaps(trace: Trace) -> dict[str, np.ndarray]:
    """Inter-turn gaps (seconds, zeros included) per AppType name, for apps with at least one gap."""
    sid = trace.session_ids()
    order = np.argsort(sid, kind="stable")  # the trace is time-sorted, so each session stays in time order
    same = sid[order][1:] == sid[order][:-1]
    gaps = np.diff(trace.t[order])[same]
    apps = trace.app[order][1:][same].astype(np.int64)
    return {AppType(a).name: gaps[apps == a] for a in range(N_APP_TYPES) if (apps == a).any()}


def _fit_gaps(gaps: np.ndarray) -> dict[str, Any]:
    pos = gaps[gaps > 0]
    res: dict[str, Any] = {"n": int(pos.size), "zero_gaps": int((gaps == 0).sum()),
                           "mean_s": float(pos.mean()) if pos.size else None,
                           "median_s": float(np.median(pos)) if pos.size else None,
                           "lognormal_mu": None, "lognormal_sigma": None, "exponential_rate": None,
                           "ks_lognormal": None, "ks_exponential": None,
                           "loglik_lognormal": None, "loglik_exponential": None, "better": None}
    if pos.size < 2:
        return res
    logs = np.log(pos)
    mu, sigma = float(logs.mean()), float(logs.std(ddof=0))
    rate = 1.0 / float(pos.mean())
    n = pos.size
    # Only the KS statistic is used; method="asymp" skips the exact p-value's cost, the statistic is the same.
    res.update(lognormal_mu=mu, lognormal_sigma=sigma, exponential_rate=rate,
               ks_exponential=float(stats.kstest(pos, "expon", args=(0.0, 1.0 / rate), method="asymp").statistic),
               loglik_exponential=float(n * math.log(rate) - rate * pos.sum()))
    if sigma > 0:
        ks = stats.kstest(pos, "lognorm", args=(sigma, 0.0, math.exp(mu)), method="asymp").statistic
        loglik = -logs.sum() - n * math.log(sigma * math.sqrt(2 * math.pi)) - ((logs - mu) ** 2).sum() / (2 * sigma**2)
        res.update(ks_lognormal=float(ks), loglik_lognormal=float(loglik))
        res["better"] = "lognormal" if res["loglik_lognormal"] > res["loglik_exponential"] else "exponential"
    return res


def characterize(trace: Trace) -> dict[str, Any]:
    """The workload study of ``trace`` as a JSON-able dict (see the module docstring for every definition)."""
    n_req = len(trace)
    s = _occurrence_stream(trace)
    n_occ = s["key"].size
    sid = trace.session_ids()
    result: dict[str, Any] = {
        "source": trace.meta.get("source"),
        "requests": n_req,
        "sessions": _n_distinct(sid),
        "block_size": trace.block_size,
        "duration_s": trace.duration,
        "block_refs": trace.n_blocks,
        "output_blocks": trace.n_output_blocks,
    }
    order = np.argsort(s["key"], kind="stable")
    key, req, typ, pos = (s[k][order] for k in ("key", "req", "type", "pos"))
    is_prompt = pos >= 0
    if n_occ:
        new_group = np.empty(n_occ, dtype=bool)
        new_group[0] = True
        np.not_equal(key[1:], key[:-1], out=new_group[1:])
        new_run = new_group.copy()
        new_run[1:] |= req[1:] != req[:-1]
        group_start, group_end = _run_bounds(new_group)
        run_start, run_end = _run_bounds(new_run)
        group_id = np.cumsum(new_group) - 1
    else:
        group_start = group_end = run_start = run_end = group_id = np.zeros(0, dtype=np.int64)
    hit = run_start > group_start  # an earlier request holds the key
    cum_prompt = np.cumsum(is_prompt, dtype=np.int64)
    later_prompt = cum_prompt[group_end] - cum_prompt[run_end]  # prompt refs of the key in later requests
    fwd = later_prompt > 0

    result["distinct_blocks"] = int(new_group.sum()) if n_occ else 0
    p_hit = hit[is_prompt]
    n_hits = int(p_hit.sum())
    result["hits"] = n_hits
    result["reuse_ratio"] = _ratio(n_hits, trace.n_blocks)

    result["by_token_type"] = _group_stats(typ, N_TOKEN_TYPES, [t.name for t in TokenType], is_prompt, hit, fwd,
                                           group_id, later_prompt)
    app_occ = trace.app[req]
    result["by_app"] = _group_stats(app_occ, N_APP_TYPES, [a.name for a in AppType], is_prompt, hit, fwd,
                                    group_id, later_prompt)

    bucket = offset_bucket(pos[is_prompt])
    nb = int(bucket.max()) + 1 if bucket.size else 0
    b_refs = np.bincount(bucket, minlength=nb)
    b_hits = np.bincount(bucket, weights=p_hit, minlength=nb)
    b_fwd = np.bincount(bucket, weights=fwd[is_prompt], minlength=nb)
    by_offset = []
    for b in range(nb):
        label, lo, hi = _bucket_label(b)
        by_offset.append({"bucket": label, "lo": lo, "hi": hi, "refs": int(b_refs[b]),
                          "hit_ratio": _ratio(b_hits[b], b_refs[b]), "reuse_ratio": _ratio(b_fwd[b], b_refs[b])})
    result["by_offset"] = by_offset

    # Previous occurrence of a hit = the last element before its run (the most recent earlier request).
    hit_idx = np.flatnonzero(hit & is_prompt)
    prev_req = req[run_start[hit_idx] - 1]
    intra = int((sid[prev_req] == sid[req[hit_idx]]).sum())
    result["intra_session_fraction"] = _ratio(intra, n_hits)
    result["cross_session_fraction"] = _ratio(n_hits - intra, n_hits)

    result["gaps"] = {app: _fit_gaps(g) for app, g in session_gaps(trace).items()}
    return result


def headroom(trace: Trace, fractions: Sequence[float] = HEADROOM_FRACTIONS) -> list[dict[str, Any]]:
    """LRU and Belady token hit rates at each cache size (a fraction of the distinct blocks), and the headroom
    ``belady - lru`` in percentage points; one dict per fraction (see the module docstring)."""
    from sae_env.cache import PrefixCache, resolve_capacity
    from sae_env.metrics import summarize
    from sae_env.policies import make_policy
    from sae_env.replay import Replay

    distinct = trace.distinct_blocks()
    rows = []
    for f in fractions:
        capacity = resolve_capacity(float(f), distinct)
        rates = {}
        for name in ("lru", "belady"):
            rep = Replay(trace, PrefixCache(capacity, make_policy(name)), window_requests=max(len(trace), 1))
            rep.run()
            rates[name] = summarize(rep.windows, policy=name, block_size=trace.block_size)["token_hit_rate"]
        rows.append({"fraction": float(f), "capacity_blocks": capacity, "lru_token_hit_rate": rates["lru"],
                     "belady_token_hit_rate": rates["belady"],
                     "headroom_pp": 100.0 * (rates["belady"] - rates["lru"])})
    return rows


def format_headroom(rows: Sequence[dict[str, Any]]) -> str:
    """:func:`headroom`'s rows as an aligned table."""
    body = [[f"{100 * r['fraction']:g}%", str(r["capacity_blocks"]), _fmt(r["lru_token_hit_rate"], True),
             _fmt(r["belady_token_hit_rate"], True), f"{r['headroom_pp']:.2f}"] for r in rows]
    return "\n".join(_table(["capacity", "blocks", "LRU token hit", "Belady token hit", "headroom (pp)"], body))


def _fmt(v: Any, pct: bool = False) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{100 * v:.1f}%" if pct else f"{v:.4g}"
    return str(v)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:  # first column left-aligned (names), numbers right-aligned
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths,
                                                                                              strict=True)))

    return [line(header), line(["-" * w for w in widths])] + [line(r) for r in rows]


def format_table(result: dict[str, Any]) -> str:
    """A readable, aligned text rendering of :func:`characterize`'s result (for stdout)."""
    r = result
    out = [f"source: {r.get('source') or '?'}   requests: {r['requests']}   sessions: {r['sessions']}   "
           f"duration: {r['duration_s']:.1f} s   block size: {r['block_size']}",
           f"prompt block refs: {r['block_refs']}   output blocks: {r.get('output_blocks', '-')}   "
           f"distinct blocks: {r['distinct_blocks']}   infinite-cache hit ratio: {_fmt(r['reuse_ratio'], True)}",
           f"hits from the same session: {_fmt(r['intra_session_fraction'], True)}   "
           f"from another session: {_fmt(r['cross_session_fraction'], True)}", ""]
    for title, key in (("token type", "by_token_type"), ("app", "by_app")):
        rows = [[name, str(d["block_refs"]), _fmt(d["reuse_ratio"], True), _fmt(d["hit_ratio"], True),
                 _fmt(d["reuses_per_block"])] for name, d in r[key].items()]
        out += _table([title, "occurrences", "fwd reuse", "hit ratio", "reuses/block"], rows) + [""]
    rows = [[d["bucket"], str(d["refs"]), _fmt(d["hit_ratio"], True), _fmt(d["reuse_ratio"], True)]
            for d in r["by_offset"]]
    out += _table(["block offset", "prompt refs", "hit ratio", "fwd reuse"], rows) + [""]
    rows = [[app, str(g["n"]), str(g["zero_gaps"]), _fmt(g["median_s"]), _fmt(g["lognormal_mu"]),
             _fmt(g["lognormal_sigma"]), _fmt(g["exponential_rate"]), _fmt(g["ks_lognormal"]),
             _fmt(g["ks_exponential"]), _fmt(g["loglik_lognormal"]), _fmt(g["loglik_exponential"]),
             g["better"] or "-"] for app, g in r["gaps"].items()]
    out += _table(["inter-turn gaps", "n", "zero", "median s", "LN mu", "LN sigma", "exp rate", "KS LN", "KS exp",
                   "loglik LN", "loglik exp", "better"], rows)
    return "\n".join(out)


def write_plots(result: dict[str, Any], trace: Trace, out_dir: str | Path) -> list[Path]:
    """Write the characterisation figures (PNG) into ``out_dir``; returns their paths."""
    from sae_env import plots  # matplotlib is imported only when figures are wanted

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [plots.plot_reuse_by_token_type(result, out_dir), plots.plot_reuse_by_app(result, out_dir),
            plots.plot_hit_by_offset(result, out_dir), plots.plot_gap_histograms(result, session_gaps(trace), out_dir)]
