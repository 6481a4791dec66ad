"""Synthetic heterogeneous workloads: a seeded parametric generator of the SAECache paper's workload kinds.

Three kinds of *sessions* arrive on one timeline, driven by a **phase schedule** (a list of phases, each with a
duration in seconds, a session arrival rate in sessions/s and a mix of kinds). Session starts in a phase form a
Poisson process (the count is Poisson(rate x duration), the starts uniform in the phase window); each start picks its
kind by the phase's mix weights. A session may run on past its phase's end (and, with ``drain=True``, past the end of
the schedule).

* ``templated`` (AppType.SINGLE_TURN): one request = system prompt (SYSTEM, from a pool of ``n_system``) + template
  (TEMPLATE, one of ``n_templates``, drawn with Zipf popularity ``P(rank k) ~ k ** -zipf_s``) + a unique user tail
  (USER); a short output (ASSISTANT).
* ``chat`` (AppType.CHAT): a system prompt from a small pool (SYSTEM), a number of turns (geometric / log-normal /
  fixed with a given mean), per turn a user message (USER) and a response (ASSISTANT), with probability
  ``reasoning_prob`` preceded by reasoning (REASONING). Turn k's prompt is turn k-1's prompt + turn k-1's response
  (without its reasoning) + the new user message; its output is [reasoning] + response. Reasoning is generated (so
  its blocks are output blocks) but dropped from the next turn's history, so those blocks are never reused.
  Gaps between consecutive turns' arrivals are log-normal(``gap_mu``, ``gap_sigma``) in ln seconds (defaults
  4.88 / 0.98, fitted on the Mooncake conversation trace, see data/README.md).
* ``agent`` (AppType.AGENT): system prompt (SYSTEM) + tool schemas (TEMPLATE), the pair drawn from a small pool of
  ``n_agents`` agent definitions shared across sessions, then the user task (USER); then steps: each step's output is
  a tool call (ASSISTANT), followed in the next prompt by the tool's output (TOOL_OUTPUT; with probability
  ``user_prob`` a user message instead), and so on; the last step's output is the final answer. Gaps are
  log-normal with agent parameters (defaults mu 1.0, sigma 0.8: seconds, not minutes).

Token content is not materialised. Every sequence is a list of *segments* (a segment table entry: length in tokens and
TokenType); a segment's content is fixed by its uid (a hash of the seed and its index in the segment table, so traces
of different seeds share no content by accident): a shared system prompt or template is one segment reused by many
sequences, a user message is a fresh segment. A block covers tokens
``[b * block_size, (b + 1) * block_size)`` of its request's sequence; its content id hashes exactly the token content it
covers: for a block inside one segment ``(uid, start offset)``, for a block that spans ``k >= 2`` segments
``(k, first uid, its start offset, every further uid, end offset in the last segment)``. Two blocks therefore get equal
content ids iff they hold equal tokens. A block's type is the dominant type of its tokens (ties go to the lower
TokenType value, as :func:`sae_env.trace.token_blocks`). Prompt blocks are the full blocks of the prompt; output
blocks are the full blocks of the whole sequence (prompt + output) beyond them, so the block straddling the end of the
prompt is an output block (it completes during decode). All requests are then chained in one vectorised call of
:func:`sae_env.trace.chain_requests`.

Prefix growth inside a chat / agent session (turn k -> k+1; exact, up to 64-bit hash collisions): turn k's prompt keys
are a prefix of turn k+1's prompt keys; if turn k has no reasoning, turn k's prompt keys followed by *all* its output
keys are a prefix of turn k+1's prompt keys (the straddling block holds the same tokens in both); if it has reasoning,
*none* of its output keys (the straddling block included, whatever its dominant type) appears in any prompt.

Lengths are drawn per segment from a log-normal parameterised by its mean (``mu = ln(mean) - sigma**2 / 2``), rounded
and clipped to ``[min, max]`` (``sigma = 0``: constant). Pool members (system prompts, templates, agent definitions)
draw their lengths once. Everything comes from one ``numpy.random.Generator(seed)``, drawn in a fixed order, so the
same configuration and seed give an identical trace.

Request phase: ``trace.meta["phases"]`` lists ``{start, end, name, mix}``; :func:`phase_of` returns each request's
phase index (by its session's start, or by its own arrival time).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sae_env.sources.synthetic_config import (
    KINDS,
    PRESETS,
    AgentConfig,
    ChatConfig,
    Count,
    Length,
    Phase,
    SyntheticConfig,
    TemplatedConfig,
    config_from_options,
    make_config,
    read_config_file,
)
from sae_env.trace import (
    AppType,
    LoadReport,
    TokenType,
    Trace,
    chain_requests,
    content_hash,
    csr_offsets,
)

__all__ = [
    "AgentConfig",
    "ChatConfig",
    "Count",
    "KINDS",
    "Length",
    "PRESETS",
    "Phase",
    "Plan",
    "SyntheticConfig",
    "TemplatedConfig",
    "generate",
    "load",
    "make_config",
    "phase_of",
    "plan",
    "poisson_arrivals",
    "read_config_file",
    "trace_from_plan",
]

_APP_OF_KIND = np.array([AppType.SINGLE_TURN, AppType.CHAT, AppType.AGENT], dtype=np.int8)


# ----------------------------------------------------------------------------------------------------------------
# Arrivals


def poisson_arrivals(rng: np.random.Generator, durations: Sequence[float],
                     rates: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """Session start times of a piecewise-constant Poisson process, and the phase index of each (sorted)."""
    times, phase = [], []
    start = 0.0
    for i, (d, r) in enumerate(zip(durations, rates, strict=True)):
        n = int(rng.poisson(r * d)) if r > 0 else 0
        times.append(start + np.sort(rng.uniform(0.0, d, n)))
        phase.append(np.full(n, i, dtype=np.int64))
        start += d
    return np.concatenate(times), np.concatenate(phase)


def _phase_windows(durations: Sequence[float]) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(np.asarray(durations, dtype=np.float64))])


def phase_of(trace: Trace, by: str = "session") -> np.ndarray:
    """Phase index of every request, from ``trace.meta["phases"]`` (``{start, end, ...}`` in order).

    ``by="session"``: the phase whose window holds the request's session start (the arrival of the session's earliest
    request in the trace); this is the phase whose mix chose the session. ``by="time"``: the phase whose window holds
    the request's own arrival. Requests outside every window get -1.
    """
    phases = trace.meta.get("phases")
    if not phases:
        raise ValueError("trace.meta has no 'phases' (only synthetic and mix traces record a phase schedule)")
    if by not in ("session", "time"):
        raise ValueError(f"by must be 'session' or 'time', got {by!r}")
    starts = np.array([float(p["start"]) for p in phases])
    ends = np.array([float(p["end"]) for p in phases])
    t = trace.t
    if by == "session" and len(trace):
        _, inv = np.unique(trace.session_ids(), return_inverse=True)
        first = np.full(inv.max() + 1, np.inf)
        np.minimum.at(first, inv, t)
        t = first[inv]
    idx = np.searchsorted(starts, t, side="right") - 1
    ok = (idx >= 0) & (t < ends[np.clip(idx, 0, None)])
    return np.where(ok, idx, -1).astype(np.int64)


# ----------------------------------------------------------------------------------------------------------------
# The plan: sessions, requests and their segment lists


def _ranks(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For CSR groups of the given lengths: the group index and the position within the group of each element."""
    lengths = np.asarray(lengths, dtype=np.int64)
    owner = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)
    pos = np.arange(owner.size, dtype=np.int64) - np.repeat(csr_offsets(lengths)[:-1], lengths)
    return owner, pos


class _SegmentTable:
    def __init__(self) -> None:
        self._len: list[np.ndarray] = []
        self._type: list[np.ndarray] = []
        self.n = 0

    def add(self, lengths: np.ndarray, types: int | np.ndarray) -> np.ndarray:
        lengths = np.asarray(lengths, dtype=np.int64)
        idx = np.arange(self.n, self.n + lengths.size, dtype=np.int64)
        self._len.append(lengths)
        self._type.append(np.broadcast_to(np.asarray(types, dtype=np.int8), lengths.shape).copy())
        self.n += lengths.size
        return idx

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if not self._len:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int8)
        return np.concatenate(self._len), np.concatenate(self._type)


@dataclass
class Plan:
    """A generated workload before blocks are cut: segment table and per-request segment lists (time order).

    Request ``i``'s sequence is segments ``segs[seg_offsets[i]:seg_offsets[i+1]]`` (indices into ``seg_len`` /
    ``seg_type``; segment content uid = hash(seed, index + 1)); the first ``n_prompt_segs[i]`` form its prompt, the
    rest its output.
    """

    block_size: int
    seed: int  # with the segment index, fixes each segment's content uid
    seg_len: np.ndarray  # int64 [S] tokens
    seg_type: np.ndarray  # int8 [S] TokenType
    t: np.ndarray  # float64 [R]
    session: np.ndarray  # int64 [R], ids in session start order
    turn: np.ndarray  # int32 [R]
    kind: np.ndarray  # int8 [R], index into KINDS
    phase: np.ndarray  # int64 [R], phase of the session's start
    reasoning: np.ndarray  # bool [R], the output starts with a reasoning segment
    template: np.ndarray  # int64 [R], template index (Zipf rank - 1) of templated requests, else -1
    segs: np.ndarray  # int64 flat segment indices
    seg_offsets: np.ndarray  # int64 [R+1] CSR into segs
    n_prompt_segs: np.ndarray  # int64 [R]
    session_start: np.ndarray  # float64 [n_sessions]
    session_kind: np.ndarray  # int8 [n_sessions]
    session_phase: np.ndarray  # int64 [n_sessions]

    def __len__(self) -> int:
        return int(self.t.size)


@dataclass
class _KindRequests:
    """Requests of the sessions of one kind, in local session order; streams are session segment histories."""

    stream: np.ndarray  # flat segment indices of each session's history stream
    stream_off: np.ndarray  # CSR per session
    session: np.ndarray  # local session index per request
    turn: np.ndarray
    rel_t: np.ndarray  # seconds since the session start
    n_prompt: np.ndarray  # prompt = stream[start : start + n_prompt]; output = [reasoning] + stream[start + n_prompt]
    reasoning_seg: np.ndarray  # segment index or -1
    template: np.ndarray


def _turn_times(rng: np.random.Generator, counts: np.ndarray, mu: float, sigma: float) -> np.ndarray:
    """Arrival offsets of each turn from its session's start: cumulative log-normal gaps, the first at 0."""
    owner, pos = _ranks(counts)
    gaps = rng.lognormal(mu, sigma, owner.size)
    gaps[pos == 0] = 0.0
    cum = np.cumsum(gaps)  # counts are >= 1, so every session owns its first entry
    return cum - np.repeat(cum[csr_offsets(counts)[:-1]], counts) if owner.size else cum


def _reasoning(rng: np.random.Generator, table: _SegmentTable, n: int, prob: float, length: Length) -> np.ndarray:
    seg = np.full(n, -1, dtype=np.int64)
    flag = rng.random(n) < prob
    seg[flag] = table.add(length.sample(rng, int(flag.sum())), TokenType.REASONING)
    return seg


def _templated(rng: np.random.Generator, cfg: TemplatedConfig, table: _SegmentTable, n: int) -> _KindRequests:
    sys_pool = table.add(cfg.system_tokens.sample(rng, cfg.n_system), TokenType.SYSTEM)
    tpl_pool = table.add(cfg.template_tokens.sample(rng, cfg.n_templates), TokenType.TEMPLATE)
    popularity = np.arange(1, cfg.n_templates + 1, dtype=np.float64) ** -cfg.zipf_s
    tpl = rng.choice(cfg.n_templates, size=n, p=popularity / popularity.sum())
    sys = rng.integers(cfg.n_system, size=n)
    user = table.add(cfg.user_tokens.sample(rng, n), TokenType.USER)
    out = table.add(cfg.output_tokens.sample(rng, n), TokenType.ASSISTANT)
    stream = np.stack([sys_pool[sys], tpl_pool[tpl], user, out], axis=1).ravel()
    return _KindRequests(stream=stream, stream_off=4 * np.arange(n + 1, dtype=np.int64),
                         session=np.arange(n, dtype=np.int64), turn=np.ones(n, dtype=np.int64), rel_t=np.zeros(n),
                         n_prompt=np.full(n, 3, dtype=np.int64), reasoning_seg=np.full(n, -1, dtype=np.int64),
                         template=tpl.astype(np.int64))


def _chat(rng: np.random.Generator, cfg: ChatConfig, table: _SegmentTable, n: int) -> _KindRequests:
    # Stream of a session with T turns: [system, user_1, response_1, ..., user_T, response_T].
    sys_pool = table.add(cfg.system_tokens.sample(rng, cfg.n_system), TokenType.SYSTEM)
    turns = cfg.turns.sample(rng, n)
    sys = rng.integers(cfg.n_system, size=n)
    owner, k = _ranks(turns)
    users = table.add(cfg.user_tokens.sample(rng, owner.size), TokenType.USER)
    resp = table.add(cfg.response_tokens.sample(rng, owner.size), TokenType.ASSISTANT)
    reason = _reasoning(rng, table, owner.size, cfg.reasoning_prob, cfg.reasoning_tokens)
    rel_t = _turn_times(rng, turns, cfg.gap_mu, cfg.gap_sigma)
    off = csr_offsets(1 + 2 * turns)
    stream = np.empty(off[-1], dtype=np.int64)
    stream[off[:-1]] = sys_pool[sys]
    stream[off[owner] + 1 + 2 * k] = users
    stream[off[owner] + 2 + 2 * k] = resp
    return _KindRequests(stream=stream, stream_off=off, session=owner, turn=k + 1, rel_t=rel_t, n_prompt=2 * k + 2,
                         reasoning_seg=reason, template=np.full(owner.size, -1, dtype=np.int64))


def _agent(rng: np.random.Generator, cfg: AgentConfig, table: _SegmentTable, n: int) -> _KindRequests:
    # Stream of a session with T steps: [system, tools, task, call_1, obs_1, ..., obs_{T-1}, call_T]; step k's
    # prompt is everything before call_k, its output call_k (the last call is the final answer).
    sys_pool = table.add(cfg.system_tokens.sample(rng, cfg.n_agents), TokenType.SYSTEM)
    tools_pool = table.add(cfg.tools_tokens.sample(rng, cfg.n_agents), TokenType.TEMPLATE)
    steps = cfg.steps.sample(rng, n)
    agent = rng.integers(cfg.n_agents, size=n)
    task = table.add(cfg.task_tokens.sample(rng, n), TokenType.USER)
    owner, k = _ranks(steps)
    calls = table.add(cfg.call_tokens.sample(rng, owner.size), TokenType.ASSISTANT)
    n_obs = int((steps - 1).sum())
    is_user = rng.random(n_obs) < cfg.user_prob
    obs_len = cfg.tool_output_tokens.sample(rng, n_obs)
    obs_len[is_user] = cfg.user_tokens.sample(rng, int(is_user.sum()))
    obs = table.add(obs_len, np.where(is_user, TokenType.USER, TokenType.TOOL_OUTPUT))
    reason = _reasoning(rng, table, owner.size, cfg.reasoning_prob, cfg.reasoning_tokens)
    rel_t = _turn_times(rng, steps, cfg.gap_mu, cfg.gap_sigma)
    off = csr_offsets(2 * steps + 2)
    stream = np.empty(off[-1], dtype=np.int64)
    stream[off[:-1]] = sys_pool[agent]
    stream[off[:-1] + 1] = tools_pool[agent]
    stream[off[:-1] + 2] = task
    stream[off[owner] + 3 + 2 * k] = calls
    has_obs = k < steps[owner] - 1
    stream[off[owner[has_obs]] + 4 + 2 * k[has_obs]] = obs
    return _KindRequests(stream=stream, stream_off=off, session=owner, turn=k + 1, rel_t=rel_t, n_prompt=3 + 2 * k,
                         reasoning_seg=reason, template=np.full(owner.size, -1, dtype=np.int64))


_KIND_BUILDERS = (("templated", _templated), ("chat", _chat), ("agent", _agent))


def plan(config: SyntheticConfig) -> Plan:
    """Draw sessions and requests (no blocks yet); deterministic given the config (its seed included)."""
    rng = np.random.default_rng(config.seed)
    starts, sess_phase = poisson_arrivals(rng, [p.duration for p in config.phases], [p.rate for p in config.phases])
    weights = np.array([[p.mix.get(k, 0.0) for k in KINDS] for p in config.phases])
    sess_kind = np.zeros(starts.size, dtype=np.int8)
    for i in range(len(config.phases)):
        sel = np.flatnonzero(sess_phase == i)
        if sel.size:
            sess_kind[sel] = rng.choice(len(KINDS), size=sel.size, p=weights[i] / weights[i].sum())

    table = _SegmentTable()
    parts: list[tuple[int, _KindRequests, np.ndarray]] = []
    for kind_idx, (name, builder) in enumerate(_KIND_BUILDERS):
        ids = np.flatnonzero(sess_kind == kind_idx)
        parts.append((kind_idx, builder(rng, getattr(config, name), table, ids.size), ids))
    seg_len, seg_type = table.arrays()

    stream = np.concatenate([p.stream for _, p, _ in parts])
    stream_base = np.cumsum([0] + [p.stream.size for _, p, _ in parts])
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("session", "turn", "t", "n_prompt", "reason", "template",
                                                         "kind", "start")}
    for (kind_idx, p, ids), base in zip(parts, stream_base[:-1], strict=True):
        sid = ids[p.session]
        cols["session"].append(sid)
        cols["turn"].append(p.turn)
        cols["t"].append(starts[sid] + p.rel_t)
        cols["n_prompt"].append(p.n_prompt)
        cols["reason"].append(p.reasoning_seg)
        cols["template"].append(p.template)
        cols["kind"].append(np.full(sid.size, kind_idx, dtype=np.int8))
        cols["start"].append(base + p.stream_off[p.session])
    c = {k: np.concatenate(v) for k, v in cols.items()}
    keep = np.ones(c["t"].size, dtype=bool)
    if not config.drain:
        keep = c["t"] < sum(p.duration for p in config.phases)
    order = np.lexsort((c["turn"], c["session"], c["t"]))
    order = order[keep[order]]
    c = {k: v[order] for k, v in c.items()}

    # Request i's segments: stream[start : start + n_prompt], then its reasoning segment if any, then the response.
    has_r = c["reason"] >= 0
    n_segs = c["n_prompt"] + 1 + has_r
    owner, pos = _ranks(n_segs)
    n_prompt = c["n_prompt"][owner]
    segs = stream[c["start"][owner] + np.minimum(pos, n_prompt)]
    is_r = has_r[owner] & (pos == n_prompt)
    segs[is_r] = c["reason"][owner[is_r]]
    return Plan(block_size=config.block_size, seed=config.seed, seg_len=seg_len, seg_type=seg_type, t=c["t"],
                session=c["session"],
                turn=c["turn"].astype(np.int32), kind=c["kind"], phase=sess_phase[c["session"]], reasoning=has_r,
                template=c["template"], segs=segs, seg_offsets=csr_offsets(n_segs), n_prompt_segs=c["n_prompt"],
                session_start=starts, session_kind=sess_kind, session_phase=sess_phase)


# ----------------------------------------------------------------------------------------------------------------
# Blocks


def _blocks(p: Plan) -> dict[str, np.ndarray]:
    """Cut every request's sequence into full blocks: content ids, dominant types, chained keys (vectorised)."""
    bs = p.block_size
    flen = p.seg_len[p.segs]
    fend = np.cumsum(flen)  # global token coordinate: every request's sequence laid end to end
    fstart = fend - flen
    r_first = p.seg_offsets[:-1]
    seq_tokens = np.add.reduceat(flen, r_first) if len(p) else np.zeros(0, dtype=np.int64)
    prompt_seg_end = r_first + p.n_prompt_segs  # first output segment
    prompt_tokens = fstart[prompt_seg_end] - fstart[r_first] if len(p) else np.zeros(0, dtype=np.int64)
    output_tokens = seq_tokens - prompt_tokens
    n_blocks = seq_tokens // bs
    n_prompt_blocks = prompt_tokens // bs

    owner, b = _ranks(n_blocks)
    bstart = fstart[r_first][owner] + b * bs
    s0 = np.searchsorted(fstart, bstart, side="right") - 1
    n_seg = p.seg_len.size
    seg_uid = content_hash(np.stack([np.full(n_seg, p.seed, dtype=np.uint64),
                                     np.arange(1, n_seg + 1, dtype=np.uint64)], axis=1))
    uid = seg_uid[p.segs]
    content = np.empty(bstart.size, dtype=np.uint64)
    types = np.empty(bstart.size, dtype=np.int8)

    single = bstart + bs <= fend[s0]
    q = s0[single]
    content[single] = content_hash(np.stack([uid[q], (bstart[single] - fstart[q]).astype(np.uint64)], axis=1))
    types[single] = p.seg_type[p.segs[q]]

    # Blocks spanning k >= 2 segments: few; grouped by k so that each row's layout depends on its content only.
    multi = np.flatnonzero(~single)
    if multi.size:
        m0 = s0[multi]
        m1 = np.searchsorted(fstart, bstart[multi] + bs - 1, side="right") - 1
        k = m1 - m0 + 1
        counts = np.zeros((multi.size, len(TokenType)), dtype=np.int64)
        rows = np.arange(multi.size)
        lo, hi = bstart[multi], bstart[multi] + bs
        for j in range(int(k.max())):
            a = np.flatnonzero(k > j)
            s = m0[a] + j
            n_tok = np.minimum(fend[s], hi[a]) - np.maximum(fstart[s], lo[a])
            counts[rows[a], p.seg_type[p.segs[s]]] += n_tok
        types[multi] = counts.argmax(axis=1)
        for kk in np.unique(k):
            a = np.flatnonzero(k == kk)
            cols = [np.full(a.size, kk, dtype=np.uint64), uid[m0[a]], (lo[a] - fstart[m0[a]]).astype(np.uint64)]
            cols += [uid[m0[a] + j] for j in range(1, int(kk))]
            cols.append((hi[a] - fstart[m1[a]]).astype(np.uint64))
            content[multi[a]] = content_hash(np.stack(cols, axis=1))

    seq_off = csr_offsets(n_blocks)
    pk, po, ok, oo = chain_requests(content, seq_off, n_prompt_blocks)
    is_prompt = b < n_prompt_blocks[owner]
    return {"prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "prompt_keys": pk, "prompt_offsets": po,
            "prompt_types": types[is_prompt], "output_keys": ok, "output_offsets": oo,
            "output_types": types[~is_prompt]}


def trace_from_plan(p: Plan, meta: dict[str, Any] | None = None) -> Trace:
    """Cut a plan's sequences into blocks and build the Trace."""
    cols = _blocks(p)
    return Trace(t=p.t, session=p.session, turn=p.turn, app=_APP_OF_KIND[p.kind], block_size=p.block_size,
                 meta=meta, **cols)


def _meta(config: SyntheticConfig, p: Plan, preset: str | None) -> dict[str, Any]:
    win = _phase_windows([ph.duration for ph in config.phases])
    phases = [{"start": float(win[i]), "end": float(win[i + 1]), "name": ph.name or f"phase{i}",
               "mix": {k: ph.mix.get(k, 0.0) for k in KINDS}, "rate": ph.rate}
              for i, ph in enumerate(config.phases)]
    sessions = {k: int((p.session_kind == i).sum()) for i, k in enumerate(KINDS)}
    return {"source": "synthetic", "preset": preset, "seed": config.seed, "config": config.to_dict(),
            "phases": phases, "kinds": list(KINDS), "sessions_per_kind": sessions}


def generate(config: SyntheticConfig | None = None, preset: str | None = None) -> Trace:
    """Generate the trace of a config (default: the defaults); same config and seed -> an identical trace."""
    config = config if config is not None else make_config(preset)
    p = plan(config)
    return trace_from_plan(p, _meta(config, p, preset))


# ----------------------------------------------------------------------------------------------------------------
# Source entry point

def load(path: str | os.PathLike | None = None, **options: Any) -> tuple[Trace, LoadReport]:
    """Generate a synthetic trace. ``path``: None, or a YAML / JSON file of the same options as ``options``.

    Options: ``preset`` (one of :data:`PRESETS`), the :class:`SyntheticConfig` fields (nested mappings are merged into
    the preset's / file's, lists replace), ``on_error`` (accepted for the common source interface; a generator reads no
    data rows, and a bad config always raises ValueError).
    """
    config, preset = config_from_options(path, options)
    p = plan(config)
    trace = trace_from_plan(p, _meta(config, p, preset))
    report = LoadReport(source="synthetic", path=str(path) if path is not None else f"<preset {preset or 'default'}>",
                        rows_read=len(trace))
    report.notes += [
        f"generated {p.session_start.size} sessions ({trace.meta['sessions_per_kind']}) and {len(trace)} requests "
        f"from seed {config.seed}, block_size {config.block_size}, {len(config.phases)} phase(s)",
        "session starts: Poisson per phase; kind by the phase's mix; sessions run on past their phase's end"
        + ("" if config.drain else "; requests after the last phase's end dropped (drain=false)"),
        "token content is synthetic: segments with content uids; blocks hash the exact segment content they cover",
        f"chat gaps log-normal(mu={config.chat.gap_mu}, sigma={config.chat.gap_sigma}); agent gaps log-normal("
        f"mu={config.agent.gap_mu}, sigma={config.agent.gap_sigma}); from the previous turn's arrival",
        "reasoning is an output segment dropped from the next turn's history (its blocks are never reused)",
    ]
    return trace, report
