"""SAECache: semantic, self-tuning eviction over four queues (arXiv 2605.18825; restated in docs/SAECACHE.md).

Queues. Every block is routed, when it is inserted, to one queue:

* priority-eviction (PE): reasoning / chain-of-thought output blocks (and the rest of an output that holds
  reasoning: the next turn drops the reasoning, so no later prompt follows that branch); emptied first;
* structural (ST): SYSTEM and TEMPLATE blocks (shared prompt structure: system prompts, tool schemas, templates);
* chat (CH) and agent (AG): the other blocks, by the request's app (tool schemas -> agent).

Ranking (the default). Within the chat and agent queues a block is worth its *hit density* (survival.py): the hits
it is expected to bring per second of cache it holds over the cache's turnover time, given the probability ``p``
that its session continues after the request that last released it and the queue's log-normal gap distribution
``LN(mu_q, sigma_q)``. ``p`` comes from an online continuation model (continuation.py) asked at *every* request,
trained on the continuations this replay has observed (right-censoring handled: a session that has not come back
yet counts by the posterior that it is still alive). The posterior ``p S(dt) / (1 - p + p S(dt))`` is what shapes
the order: a session idle far past its typical gap is probably over, and one idle for a while may be closer to its
next turn than a fresh one. Structural blocks are ranked the same way, as the shared prefixes they belong to: ``p``
is the rate at which a use of a shared prefix is followed by another, the gaps those between uses. The lowest
``alpha_q * w_type * D`` goes first; any evictable PE block before every other block.

The paper's ranking (``continuation=False, density=False``, and its three multiplicative mechanisms on; the
``saecache-paper`` policy): ``P(b) = alpha_q * w_type(b) * p_q(b) / dt_b`` with ``p_q`` the log-normal survival for
chat and agent (exponential when ``lognormal`` is off), ``1 - x_b ** gamma`` for structural (``x_b`` = the block's
offset / its prompt's length), 1 for PE; a session's first request routed by the session predictor, or by rule
(tool schemas -> agent, a templated prompt -> PE, anything else -> chat). Inside a group every block then shares
``alpha``, ``w`` and the survival curve, and ``S(dt) / dt`` falls with ``dt``: each group evicts in LRU order. On
real sessions the queues collapse into one or two groups and the paper's ranking makes LRU's decisions; hence the
default. What differs from the paper, and why, is in the README ("SAECache"). The type weights, queue weights and
position decay are off by default: under the hit density they did not help on real traces (configs/ablation.yaml).

Victim selection. Unpinned blocks belong to one recency list per group, in release order (vLLM's free-queue order): a
group is (queue, type when ``type_weights``, continuation bin, value bin when ``hit_value``), the continuation bin
being ``logit p`` rounded to ``LOGIT_BIN``, so that every block of a group shares one score function of its idle time.
Under the paper's ranking that function falls with idle time, so a group's minimum is its least recently released
leaf; under the hit density it rises, then falls (quasi-concave, tested), so the minimum is its least or most recently
released leaf: two candidates per group. In a structural group the offset may also matter (position decay), so the
first ``sample`` leaves from its head are candidates (Redis / LRB-style sampling); tests measure how often this
differs from the exact argmin over all evictable blocks. Only leaves are evictable: an inner node (a shared system
prompt stays one for as long as any session hangs below it) is parked aside, and when its last child goes it returns
to its group through small heaps ordered by its release stamp, so the group's order stays exact.

Cost. A request acquires and releases its whole hit prefix (hundreds of blocks, nearly all inner nodes), so that
path does almost nothing per block: acquiring is free (a pinned block's list entry is just dead until its release
appends a fresh one), releasing stamps each block and lists only what a scan can need (see ``on_release``). Dead
entries are dropped when a scan meets them and by an occasional compaction. Each group's candidates are kept and
rescored at a new instant unless something joined or left them; nearly every eviction of an insertion run takes the
parent of the previous victim, which is recognised without a scan (see ``evict``).

Parameters (a named, bounded vector agents can set): ``alpha_st, alpha_ch, alpha_ag``, one ``w_<TYPE>`` per token
type, ``mu_chat, sigma_chat, mu_agent, sigma_agent``, ``gamma``, ``mu_structural, sigma_structural``. The online
learners that set them after every window live in :mod:`agents.sae_online` (this module only measures what they
need, in :meth:`window_stats`). The continuation model, the shared prefixes' reuse rate and the turnover time are
the policy's own online estimates, part of the ranking as LPC's rates are part of LPC: updated at every arrival,
refitted every ``REFIT_EVERY`` arrivals whatever the replay's window (see ``_refit``; the continuation model at those
of them its ``refit_growth`` schedule picks, and at any arrival once a typical chat gap has passed since its last
refit).

Switches (ablations): ``continuation`` (off: p = 1, no continuation model), ``density`` (off: the paper's ``p_q / dt``),
``continuation_features`` (off: per-turn rates only), ``censoring`` (off: a pending session counts as ended, as LPC
counts), ``timed_refit`` (off: the continuation model refits by the count of arrivals alone, so where they thin out its
soft weights and ended labels stay as they were at its last refit), ``posterior_end`` (off: a pending session counts as
ended only once idle past the horizon, not already once the posterior that it is alive is below 1 %), ``pe_routing``
(on: requests with p below ``continue_threshold`` go to PE), ``hit_value`` (on: a chat or agent block's density is
weighed by what a hit on it saves, the prefill FLOPs of recomputing it, ``1 + context / value_context`` under the
roofline, binned in quarter octaves; for TTFT on long prompts, at some cost in token hits; ``value_context``, in
tokens, defaults to the paper's model's, Qwen2.5-1.5B's 15,234: give another model's ``N / (2 L d)``),
``rebin`` (on by default wherever the continuation model and the hit density are, which its bins need: at the refits,
every ``REFIT_EVERY`` arrivals, where the continuation model has moved since the last rebinning, each evictable chat or
agent block moves to the continuation bin of the request that released it as the model sees that request *now*, a
parked one when it returns; off: a block keeps the bin the model gave its request at the request's arrival, when the
model knew less: an online model's early answers are its worst, and a block binned by them keeps them),
``empirical_gaps`` (on: the chat and agent queues' hit density reads a gap distribution of the shape of the session
gaps completed so far, with the learners' log-normal as a prior of ``EMPIRICAL_PRIOR`` pseudo-gaps, rebuilt at every
refit: survival.EmpiricalGaps; the continuation model keeps the log-normal), ``gap_mixture`` (on: the same
queues' hit density reads two log-normals mixed, fitted to the gaps completed so far with the learners' log-normal as
the same prior, refitted once the gaps have grown by ``refit_growth`` since the last fit, where BIC prefers them to one
log-normal, the learners' log-normal otherwise: survival.fit_gap_mixture; not with ``empirical_gaps``),
``gap_select`` (on: at every refit each chat, agent and structural queue's hit density reads the learners' log-normal
or the exponential of the same mean, whichever the cure model's likelihood of this cache's own hits, evictions and
idle blocks prefers so far: gap_shape.py; not with ``empirical_gaps`` or ``gap_mixture``),
``type_weights`` (off: w = 1), ``adaptive_alpha`` (off:
alpha = 1), ``lognormal`` (off: exponential gaps), ``position_decay`` (off: no offset term), ``multi_queue`` (off: one
temporal queue, no PE priority), ``predictor`` (the paper's ranking: off routes first requests by rule only; under the
continuation model a predictor is one of its features). With every switch off the policy evicts in LRU order (a test
checks it against ``lru``). Not a switch but cost knobs: ``refit_steps`` (2), the continuation model's EM and Newton
steps per refit, and ``refit_growth`` (0.5): the model refits once the arrivals have grown by half since its last refit,
not at every ``REFIT_EVERY`` arrivals (0; continuation.py's refit schedule: a bounded total cost, the same hit rates
within noise); ``rebin_every`` (1): under ``rebin``, the blocks move at every ``rebin_every``-th refit only;
``rebin_move`` (``REBIN_MOVE``, half a continuation bin): under ``rebin``, the blocks move only once the model has
moved since the last rebinning, ``beta`` refitted or a turn's rate by more than this in logit (0: at any move, the
decisions of rebinning at every refit);
``idle_sample`` (``IDLE_SAMPLE``): under ``gap_select``, the blocks of a full cache it follows from release to hit
or eviction and a refit counts idle, at least (twice as many at most: gap_shape.idle_every), and ``census``
(``CENSUS``, 4): the idle ones are counted until the cache has evicted this many times its capacity (then only the
hits and evictions; ``inf``: at every choice, gap_shape.census_on);
``clock_step`` (1/128; 0 under the paper's ranking), the step of the clock the ranking reads, as a fraction of the
turnover horizon (``CLOCK_STEP``: the evictions of every arrival within one step share one scan's
scores; 0: the exact clock).

Why one piece (~900 lines): the recency lists, the returned-heaps and the cached candidates are the policy's state,
not a container beside it. Every hook moves a block between them while it routes and scores it (``on_release``
stamps, groups and lists a block in one pass; ``evict`` takes the parent of its last victim by knowing how that
victim was scored), and ``check_invariants`` checks both together. A separate candidate structure would cost a call
per released block on the hottest path and split one invariant across two modules. The scoring math lives apart
(survival.py, continuation.py); what is left is routing, grouping and victim selection, which share every field.
"""

from __future__ import annotations

import heapq
import inspect
import math
from collections import deque
from typing import Any

import numpy as np

from sae_env.block import TYPE_SLOTS, Block, split_queue_type
from sae_env.policies.arrivals import (
    AG,
    CH,
    N_QUEUES,
    N_SLOTS,
    PE,
    QUEUES,
    REBIN_MOVE,
    REFIT_EVERY,
    ST,
    Arrivals,
    Predictor,
    model_moved,
    rebin_last,
    rebin_last_state,
    slot_of,
    slot_p,
)
from sae_env.policies.base import EvictionPolicy, ParamSpec, block_array
from sae_env.policies.gap_shape import CENSUS, IDLE_SAMPLE, GapShapeChoice, census_on, idle_every
from sae_env.policies.survival import (
    EmpiricalGaps,
    ExponentialGaps,
    GapCounts,
    GridGaps,
    LognormalGaps,
    fit_gap_mixture,
    mixture_gaps_used,
)
from sae_env.serving.hardware import GPUS, MODELS
from sae_env.serving.roofline import RooflineCost
from sae_env.trace import N_TOKEN_TYPES, TokenType, Trace

__all__ = ["AG", "CH", "CLOCK_STEP", "EMPIRICAL_PRIOR", "GROUP_SLOT", "PAPER", "PARAM_SPECS", "PE", "QUEUES", "ST",
           "VALUE_STRIDE", "EmpiricalShapes", "Predictor", "SAECachePaperPolicy", "SAECachePolicy", "gap_models",
           "value_bins", "value_weight"]

_SQRT2 = math.sqrt(2.0)
_STRUCTURAL_TYPES = (TokenType.SYSTEM, TokenType.TEMPLATE)
_COMPACT_MIN = 1 << 18  # released blocks before the first compaction of the recency lists (a few MB of entries)
# The ranking's clock step, as a fraction of the horizon (``clock_step``): evict reads the clock rounded up to a
# multiple of ``CLOCK_STEP * horizon``, so every eviction within one step sees the same scores and a scan at the step's
# first eviction serves the rest (only groups something joined or left are scanned again). A block's score then lags its
# true value by at most this much idle time; under the hit density that moves it by about 1 % once it has been idle for
# a horizon (it falls by under 5 % over a 32nd of the horizon there: tests of the compiled scan's bound),
# less than the online gap and continuation estimates it rests on can tell apart. A first-principles resolution, not a
# fit to a trace (docs/saecache-real-traces.md, "Decision time": what it changes in hits and in time).
CLOCK_STEP = 1.0 / 128
# empirical_gaps: the log-normal prior's weight, in gaps. The online learners shrink their log-normal fit towards
# the current constants by as many pseudo-gaps (agents.sae_online.OnlineConfig.gap_prior), so the shape starts as
# the log-normal's and moves to the gaps' own as they outnumber it.
EMPIRICAL_PRIOR = 50.0
_CONSTANT, _LOGNORMAL, _EXPONENTIAL, _POSITION, _DENSITY = range(5)  # kinds of ranking term (see _constants)
GROUP_SLOT = _SLOT = 64  # group id = queue_type_code(queue, type) + _SLOT * slot: the code fits below _SLOT
# Under ``hit_value`` a chat or agent group also carries its blocks' value bin: group id + VALUE_STRIDE * bin.
VALUE_STRIDE = _SLOT * (N_SLOTS + 1)
_VALUE_BINS_PER_OCTAVE = 4  # value bins a factor 2 ** (1 / 4) = 1.19 wide: a block's value is within 9 % of its bin's
_ST_GROUPS = tuple(range(ST * TYPE_SLOTS, (ST + 1) * TYPE_SLOTS))  # the structural groups (no continuation bin)
_REASONING, _TEMPLATE = int(TokenType.REASONING), int(TokenType.TEMPLATE)  # plain ints: enum lookups cost more


def _value_context(model: str = "qwen2.5-1.5b") -> float:
    """The context (tokens before a block) at which recomputing the block costs twice what it costs at the start of a
    prompt: FLOPs per token in the linear layers over FLOPs per (query, key) pair (the prefill roofline's terms; the
    GPU does not enter the ratio). The attention term grows with the context, the linear one does not."""
    lin, pair = RooflineCost(MODELS[model], GPUS["a40"]).terms()[:2]
    return lin / pair


_VALUE_CONTEXT = _value_context()  # the paper's model, Qwen2.5-1.5B: 15,234 tokens


def value_bins(n: int, block_size: int, value_context: float) -> list[int]:
    """The value bins of the blocks at depths ``0 .. n-1`` (hit_value): ``floor(4 log2(1 + context /
    value_context))``, the context being the ``depth * block_size`` tokens before a block. A hit saves recomputing
    the block, whose FLOPs per token are the linear layers' plus attention over its context: ``1 + context /
    value_context`` times those of a block at the start of a prompt (``value_context``: :func:`_value_context` of the
    model served). The policy and its compiled twin both read their bins from here."""
    return [int(_VALUE_BINS_PER_OCTAVE * math.log2(1.0 + depth * block_size / value_context)) for depth in range(n)]


def value_weight(k: int) -> float:
    """The geometric centre of value bin ``k``, the factor a block's hit density is weighed by (hit_value)."""
    return 2.0 ** ((k + 0.5) / _VALUE_BINS_PER_OCTAVE)


PARAM_SPECS: tuple[ParamSpec, ...] = (
    ParamSpec("alpha_st", 0.05, 20.0, 1.0, log=True, doc="queue weight, structural"),
    ParamSpec("alpha_ch", 0.05, 20.0, 1.0, log=True, doc="queue weight, chat"),
    ParamSpec("alpha_ag", 0.05, 20.0, 1.0, log=True, doc="queue weight, agent"),
    *(ParamSpec(f"w_{t.name.lower()}", 0.05, 20.0, 1.0, log=True, doc=f"token-type weight, {t.name}")
      for t in TokenType),
    ParamSpec("mu_chat", -7.0, 10.0, 4.88, doc="log-normal mu of chat re-access gaps (ln s)"),
    ParamSpec("sigma_chat", 0.1, 4.0, 0.98, doc="log-normal sigma of chat re-access gaps"),
    ParamSpec("mu_agent", -7.0, 10.0, 1.0, doc="log-normal mu of agent re-access gaps (ln s)"),
    ParamSpec("sigma_agent", 0.1, 4.0, 0.8, doc="log-normal sigma of agent re-access gaps"),
    ParamSpec("gamma", 0.05, 20.0, 1.0, log=True, doc="position decay power of structural blocks"),
    ParamSpec("mu_structural", -7.0, 12.0, 3.4, doc="log-normal mu of structural re-access gaps (ln s)"),
    ParamSpec("sigma_structural", 0.1, 4.0, 2.0, doc="log-normal sigma of structural re-access gaps"),
)


def _queue_of(g: int) -> int:
    """The queue of a group id."""
    return split_queue_type(g % _SLOT)[0]


class _RecencyList:
    """One group's released blocks in release order, as parallel deques of (release stamp, block).

    An entry is live while its block still carries that stamp and no request pins it; others are dead (the block
    was acquired since, evicted or parked) and are dropped lazily. Two deques rather than one of tuples: a tuple per
    released block would cost an allocation each and keep the garbage collector busy.
    """

    __slots__ = ("stamps", "blocks")

    def __init__(self, stamps=(), blocks=()) -> None:
        self.stamps: deque[int] = deque(stamps)
        self.blocks: deque[Block] = deque(blocks)

    def live(self) -> list[tuple[int, Block]]:
        return [(s, b) for s, b in zip(self.stamps, self.blocks, strict=True) if b.stamp == s and not b.pins]


class SAECachePolicy(EvictionPolicy):
    name = "saecache"
    param_specs = PARAM_SPECS
    queue_names = QUEUES

    def __init__(self, *, type_weights: bool = False, adaptive_alpha: bool = False, lognormal: bool = True,
                 position_decay: bool = False, multi_queue: bool = True, predictor: Predictor | bool | None = None,
                 continuation: bool = True, density: bool = True, continuation_features: bool = True,
                 censoring: bool = True, timed_refit: bool = True, posterior_end: bool = True,
                 pe_routing: bool = False, hit_value: bool = False, rebin: bool | None = None,
                 empirical_gaps: bool = False, gap_mixture: bool = False, gap_select: bool = False,
                 continue_threshold: float = 0.5,
                 sample: int = 8, min_dt: float = 1e-3, refit_steps: int = 2, refit_growth: float = 0.5,
                 value_context: float | None = None, clock_step: float = CLOCK_STEP, rebin_every: int = 1,
                 rebin_move: float = REBIN_MOVE, idle_sample: int = IDLE_SAMPLE, census: float = CENSUS,
                 params: dict[str, float] | None = None) -> None:
        super().__init__()
        if sample < 1:
            raise ValueError(f"saecache: sample must be >= 1, got {sample}")
        if not min_dt > 0:
            raise ValueError(f"saecache: min_dt must be positive, got {min_dt}")
        if isinstance(clock_step, bool) or not isinstance(clock_step, (int, float)) or not 0 <= clock_step <= 1:
            raise ValueError(f"saecache: clock_step must be a number in [0, 1] (a fraction of the horizon; 0: the "
                             f"exact clock), got {clock_step!r}")
        self.clock_step = float(clock_step)  # see CLOCK_STEP and clock
        flags = {"type_weights": type_weights, "adaptive_alpha": adaptive_alpha, "lognormal": lognormal,
                 "position_decay": position_decay, "multi_queue": multi_queue, "continuation": continuation,
                 "density": density, "continuation_features": continuation_features, "censoring": censoring,
                 "timed_refit": timed_refit, "posterior_end": posterior_end, "pe_routing": pe_routing,
                 "hit_value": hit_value, "rebin": rebin if rebin is not None else continuation and density,
                 "empirical_gaps": empirical_gaps,
                 "gap_mixture": gap_mixture, "gap_select": gap_select}
        for name, value in flags.items():  # bool("false") is True: a typo must not flip a switch on silently
            if not isinstance(value, (bool, np.bool_)):
                raise ValueError(f"saecache: {name} must be true or false, got {value!r}")
        self.switches = {name: bool(value) for name, value in flags.items()}
        self.switches["predictor"] = predictor is not False
        self._multi, self._typed = self.switches["multi_queue"], self.switches["type_weights"]  # hot-path copies
        self._st_groups = _ST_GROUPS if self._typed else _ST_GROUPS[:1]  # untyped: one structural group
        self._continuation, self._density = self.switches["continuation"], self.switches["density"]
        self._decay = self.switches["position_decay"]
        self._valued = self.switches["hit_value"]
        self._rebin = self.switches["rebin"]
        if self._rebin and not (self._continuation and self._density):
            raise ValueError("saecache: rebin moves blocks between continuation bins, which exist only with the "
                             "continuation model and the hit density (continuation=True, density=True)")
        # empirical_gaps or gap_mixture: the chat and agent queues' distributions are shaped by their gaps so far
        self._empirical = self.switches["empirical_gaps"] or self.switches["gap_mixture"]
        self.refit_growth = refit_growth  # (validated by the continuation model) gap_mixture's refit schedule too
        self._shapes = EmpiricalShapes(mixture=gap_mixture, growth=refit_growth)
        for name in ("empirical_gaps", "gap_mixture"):
            if self.switches[name] and not (self._density and self.switches["lognormal"]):
                raise ValueError(f"saecache: {name} shapes the hit density's gap distribution, with the log-normal "
                                 f"as its prior: it needs density=True and lognormal=True")
        if empirical_gaps and gap_mixture:
            raise ValueError("saecache: empirical_gaps and gap_mixture are two shapes of the same gaps: choose one")
        if gap_select and (self._empirical or not (self._density and self.switches["lognormal"])):
            raise ValueError("saecache: gap_select chooses between the log-normal and the exponential of the hit "
                             "density: it needs density=True and lognormal=True, without empirical_gaps or "
                             "gap_mixture")
        # gap_select: each temporal and structural queue's gap shape, chosen by this cache's re-accesses (gap_shape.py)
        self._shape = GapShapeChoice((CH, AG, ST)) if gap_select else None
        if isinstance(idle_sample, bool) or not isinstance(idle_sample, (int, np.integer)) or idle_sample < 1:
            raise ValueError(f"saecache: idle_sample must be a whole number of blocks >= 1, got {idle_sample!r}")
        self.idle_sample = int(idle_sample)  # gap_select: blocks of a full cache it follows, at least (a cost knob)
        if isinstance(census, bool) or not isinstance(census, (int, float)) or not census > 0:  # NaN fails too
            raise ValueError(f"saecache: census must be a number of turnovers > 0 (infinite, .inf on a command line: "
                             f"at every choice), got {census!r}")
        self.census = float(census)  # gap_select: idle blocks counted until the cache evicted this many caches
        # rebin: the request that last released each cached chat or agent block, and each such request's bin as the
        # continuation model saw it at the last rebinning (see _rebin_blocks)
        self._released_by: dict[Block, int] = {}
        self._bin_now: dict[int, int] = {}
        self._completing = -1  # the request whose blocks the next release frees (set by on_complete)
        if isinstance(rebin_every, bool) or not isinstance(rebin_every, (int, np.integer)) or rebin_every < 1:
            raise ValueError(f"saecache: rebin_every must be a whole number of refits >= 1, got {rebin_every!r}")
        self.rebin_every = int(rebin_every)  # rebin at every rebin_every-th refit (a cost knob)
        if isinstance(rebin_move, bool) or not isinstance(rebin_move, (int, float)) \
                or not rebin_move >= 0:  # NaN fails too; inf: where beta is refitted only
            raise ValueError(f"saecache: rebin_move must be a number >= 0 (logit units), got {rebin_move!r}")
        self.rebin_move = float(rebin_move)  # ... and only once the model has moved by this much (a cost knob)
        self._rebin_last: tuple[np.ndarray, np.ndarray] | None = None  # the model's rates and beta at the last one
        if value_context is None:
            value_context = _VALUE_CONTEXT
        if isinstance(value_context, bool) or not isinstance(value_context, (int, float)) \
                or not (math.isfinite(value_context) and value_context > 0):
            raise ValueError(f"saecache: value_context must be a positive number of tokens, got {value_context!r}")
        self.value_context = float(value_context)  # hit_value: the context at which a block's recompute cost doubles
        self._value_bin: list[int] = []  # depth -> value bin (hit_value), grown as deeper blocks are released
        self._block_size = 1
        # Structural groups are sampled where a block's offset weighs its score (the paper's position decay);
        # otherwise every block of a group shares one score function of idle time, as in the temporal groups,
        # and they are kept like them (leaves listed, oldest and newest candidates).
        self._st_sampled = not self._density or self.switches["position_decay"]
        self.predictor: Predictor | None = predictor if callable(predictor) else None
        self.continue_threshold = continue_threshold
        self.sample = int(sample)
        self.min_dt = float(min_dt)
        # What is learned from the arrivals alone (the continuation model, the sessions' gaps, the shared
        # prefixes' reuse rate): public, as the compiled twin runs it ahead of its request loop.
        self.arrivals = Arrivals(multi_queue=multi_queue, continuation=continuation, density=density,
                                 continuation_features=continuation_features, censoring=censoring,
                                 pe_routing=pe_routing, continue_threshold=continue_threshold,
                                 refit_steps=refit_steps, refit_growth=refit_growth, timed_refit=timed_refit,
                                 posterior_end=posterior_end, predictor=self.predictor,
                                 keep_gaps=self._empirical)
        self._lists: dict[int, _RecencyList] = {}  # group (queue-type code + _SLOT * slot) -> recency list
        self._returned: dict[int, list[tuple[int, int, Block]]] = {}  # group -> heap of (stamp, key, block)
        self._returned_new: dict[int, list[tuple[int, int, Block]]] = {}  # same blocks, newest first (-stamp)
        self._compact_at = _COMPACT_MIN  # the release count at which the lists are compacted next
        # Best candidate per group, valid while no block is acquired or released and the clock stands still: the
        # evictions of one insertion run reuse it and refresh only the groups they touched.
        self._cand: dict[int, tuple[int, float, int, int, Block]] = {}  # see _best
        self._cand_now: float | None = None
        # The candidates behind each group's best, with their stamps: at a new instant a group whose candidates are
        # all still valid (same stamp, unpinned, leaves) and that nothing was added to (_dirty) is only
        # rescored, not scanned again. Acquires and releases mark the candidates _stale (to be validated).
        self._held: dict[int, list[tuple[Block, int]]] = {}
        self._stale = False

        self._memo: dict[tuple[int, float], float] = {}  # (group, release time) -> score at _memo_now
        self._memo_now: float | None = None
        self._dirty: set[int] = set()
        # The next victim when an insertion run keeps evicting up one path (nearly every eviction): the parent of
        # the last victim, released right after it into the same group (see evict). Its on_leaf push is deferred.
        self._next_up: Block | None = None
        self._next_stamp = 0
        self._deferred: Block | None = None
        self._released = 0
        # request context, set by on_request / on_complete
        self._prompt_queue = PE  # queue of the current request's non-structural prompt blocks
        self._output_queue = PE  # queue of its non-reasoning output blocks
        self._slot = 0  # continuation bin of the current request (0: none)
        self._n_prompt = 1
        self._now = 0.0  # latest arrival
        self._evict_now = 0.0  # the instant of the eviction under way (gap_select scores the victim's idle time)
        self._inflight: dict[int, tuple[int, int]] = {}  # request -> (queue, slot) chosen at its arrival
        self._output_reasoning = False  # the completing request's output holds reasoning
        self._occupancy = [0] * N_QUEUES
        # The cache's turnover time (capacity / blocks inserted per second): how long a block stays anyway, the
        # horizon of the hit density. Before the first measurement, the chat queue's mean gap.
        self._horizon: float | None = None
        self._ins_rate: float | None = None
        self._window_inserted = 0
        self._window_t0: float | None = None
        self.reset_window()
        if params:
            self.set_params(params)
        else:
            self.params_changed()

    # -- parameters ------------------------------------------------------------------------------------------
    def params_changed(self) -> None:
        p, sw = self._params, self.switches
        ones = [1.0] * N_QUEUES
        self._alpha = ([1.0, p["alpha_st"], p["alpha_ch"], p["alpha_ag"]] if sw["adaptive_alpha"] else ones)
        self._w = ([p[f"w_{t.name.lower()}"] for t in TokenType] if sw["type_weights"] else [1.0] * N_TOKEN_TYPES)
        self._ln = _lognormal_params(p)
        self._exp_mean = {q: math.exp(mu + s * s / 2) for q, (mu, s) in self._ln.items()}
        self._gaps = gap_models(p, sw["lognormal"])
        self.arrivals.gaps = (self._gaps[CH], self._gaps[AG])  # the continuation model's, log-normal in any case
        if self._shape is not None:
            self._read_shapes()
        if self._empirical and self._params_watcher is None:  # (watched: the compiled engine ranks, and rebuilds)
            self._empirical_gaps()
        self._gamma = p["gamma"]
        # per group: (PE flag, ranking kind, its two constants, alpha * w), see _constants
        self._consts: dict[int, tuple[int, int, Any, Any, float]] = {}
        self._cand_now = None
        self._memo_now = None

    def _constants(self, g: int) -> tuple[int, int, Any, Any, float]:
        c = self._consts.get(g)
        if c is None:
            sw = self.switches
            q, t = split_queue_type(g % _SLOT)
            if self._density and q != PE:
                p = self.arrivals.p_structural if q == ST else slot_p(g % VALUE_STRIDE // _SLOT)
                kind, c1, c2 = _DENSITY, self._gaps[q], p
            elif q == CH or q == AG:
                mu, sigma = self._ln[q]
                kind, c1, c2 = (_LOGNORMAL, mu, sigma * _SQRT2) if sw["lognormal"] else (_EXPONENTIAL,
                                                                                         self._exp_mean[q], 0.0)
            elif q == ST and sw["position_decay"]:
                kind, c1, c2 = _POSITION, self._gamma, 0.0
            else:
                kind, c1, c2 = _CONSTANT, 0.0, 0.0
            flag = 0 if (q == PE and sw["multi_queue"]) else 1
            coef = self._alpha[q] * self._w[t]
            if self._valued and (q == CH or q == AG):  # structural blocks, at the prompts' start, weigh 1
                coef *= value_weight(g // VALUE_STRIDE)
            c = self._consts[g] = (flag, kind, c1, c2, coef)
        return c

    def _value_bin_of(self, depth: int) -> int:
        """The value bin of a block at ``depth`` (hit_value; :func:`value_bins`)."""
        bins = self._value_bin
        if len(bins) <= depth:  # grown in doublings: deeper blocks come one at a time
            bins.extend(value_bins(max(depth + 1, 2 * len(bins)), self._block_size, self.value_context)[len(bins):])
        return bins[depth]

    def _rank(self, kind: int, c1: Any, c2: Any, dt: float, b: Block) -> float:
        """The ranking term of block ``b`` idle ``dt`` seconds, before ``alpha_q * w_type``; lowest goes first."""
        if kind == _DENSITY:
            d = c1.density(c2, dt, self.horizon)
            if b.queue == ST and self.switches["position_decay"]:
                d *= 1.0 - b.pdata ** self._gamma
            return d
        return _survival(kind, c1, c2, dt, b.pdata) / dt

    # -- routing ---------------------------------------------------------------------------------------------
    def bind(self, trace: Trace) -> None:
        self.arrivals.bind(trace)

    def on_request(self, trace: Trace, i: int, now: float) -> None:
        arrivals = self.arrivals
        self._now = now
        if self._window_t0 is None:
            self._window_t0 = now
        q, slot, refit, structural = arrivals.arrive(trace, i, now)  # binds the trace first if it is new
        if self._valued and trace.block_size != self._block_size:  # value bins count tokens of this trace's blocks
            self._block_size, self._value_bin = trace.block_size, []
        if refit:
            self._refit(now)
        self._inflight[i] = (q, slot)
        self._prompt_queue = self._output_queue = q
        self._slot = slot
        self._n_prompt = arrivals.n_prompt_of[i]
        if structural:
            # The structural groups' density moved, no other group's: the next eviction scans them again, and the
            # other groups keep their keys if the clock stands still (evict's fast path waits for that scan).
            lists, consts, dirty = self._lists, self._consts, self._dirty
            scored = False
            for g in self._st_groups:
                if consts.pop(g, None) is not None:
                    scored = True
                if g in lists:
                    dirty.add(g)
            if scored:
                self._memo.clear()  # it holds their old scores, also at this same instant
            self._stale = True

    def on_complete(self, trace: Trace, i: int, now: float) -> None:
        arrivals = self.arrivals
        if trace is not arrivals.trace:
            self.bind(trace)
        # A generation that opens with reasoning, which the next turn's template drops: every block of this output
        # (the answer too) lies on a branch no later prompt follows.
        self._output_reasoning = arrivals.reasoning_of[i]
        ctx = self._inflight.pop(i, None)
        if ctx is None:
            ctx = (arrivals.session_queue(trace, i), self._slot)
        self._output_queue, self._slot = ctx
        self._n_prompt = arrivals.n_prompt_of[i]
        self._completing = i

    def on_insert(self, block: Block, now: float) -> None:
        t = block.type
        output = block.depth >= self._n_prompt
        if not self._multi:
            q = CH
        elif t == _REASONING or (output and self._output_reasoning):
            q = PE
        elif t <= _TEMPLATE:
            q = ST
            block.pdata = min(block.depth / self._n_prompt, 1.0)  # x_b, the block's relative offset
        else:
            q = self._output_queue if output else self._prompt_queue
        block.queue = q
        self._occupancy[q] += 1
        self._window_inserted += 1

    # -- recency lists -----------------------------------------------------------------------------------------
    def _group(self, b: Block) -> int:
        if (b.queue == CH or b.queue == AG) and b.pdata is not None:
            g = b.pdata  # set at the block's release: its releasing request's continuation bin
            if self._rebin:  # or that request's bin at the last rebinning, if it came before it
                slot = self._bin_now.get(self._released_by.get(b, -1))
                if slot is not None:
                    g += (slot - g % VALUE_STRIDE // _SLOT) * _SLOT
            return g
        return b.queue * TYPE_SLOTS + (b.type if self._typed else 0)  # queue_type_code, inlined: per eviction

    def _list(self, g: int) -> _RecencyList:
        lst = self._lists.get(g)
        if lst is None:
            lst = self._lists[g] = _RecencyList()
        return lst

    def on_acquire(self, blocks: list[Block]) -> None:
        # Nothing per block: a pinned block's list or heap entry is dead (pins > 0) and its release appends a new
        # one. Only the cached candidates may be pinned now.
        self._flush()
        self._stale = True

    def on_release(self, blocks: list[Block], now: float) -> None:
        """Stamp every released block; list only the ones a scan can need.

        * Chat, agent and PE groups (candidates: the oldest evictable block, and under ``density`` the newest) list
          the blocks that are leaves when released: in a release only the deepest block can be, as every other one
          has its path child. The others are parked from the start: an unpinned block gains no child, so it becomes
          evictable only through on_leaf, which puts it in the returned-heaps. The group's oldest (newest)
          evictable block is the older (newer) of the list's end and the heap's top, whichever way the parked
          blocks were placed, so the candidates are the ones of a list holding every block.
        * Structural groups list every released block: their sample is the first ``sample`` leaves of the list,
          and which blocks those are depends on where the inner nodes sit, so an inner node is parked only when a
          scan meets it (see _structural_candidates).

        A chat or agent block's group carries the releasing request's continuation bin (``pdata``) and, under
        ``hit_value``, the value bin of its depth.
        """
        self._flush()
        self._stale = True
        tw, valued = self._typed, self._valued
        slot = self._slot * _SLOT
        seq = self._released
        dirty = self._dirty
        st_sampled = self._st_sampled
        last_g, stamps, members = -1, None, None
        for b in blocks:
            seq += 1
            b.stamp = seq
            q = b.queue
            g = q * TYPE_SLOTS + (b.type if tw else 0)  # queue_type_code, inlined on the hottest loop
            if q == CH or q == AG:
                g += slot
                if valued:
                    g += VALUE_STRIDE * self._value_bin_of(b.depth)
                b.pdata = g
            if not b.n_children or (q == ST and st_sampled):
                if g != last_g:  # a request's blocks come in long runs of one group: one lookup per run
                    last_g = g
                    lst = self._list(g)
                    stamps, members = lst.stamps, lst.blocks
                    dirty.add(g)
                stamps.append(seq)
                members.append(b)
        self._released = seq
        if self._shape is not None:
            self._shape.released(blocks, now, self._sample_every())
        if self._rebin:
            by, i = self._released_by, self._completing
            for b in blocks:
                if b.queue == CH or b.queue == AG:
                    by[b] = i
        if seq > self._compact_at:
            self._compact()

    def on_leaf(self, block: Block) -> None:
        if block.pins:
            return  # listed again when released
        if block is self._next_up:
            self._deferred = block  # evict will most likely take it next: push it only if it does not
            return
        self._flush()
        self._return(block)

    def _flush(self) -> None:
        """Push the deferred block (see on_leaf) where it belongs, if it is still evictable."""
        b = self._deferred
        if b is not None:
            self._deferred = None
            if b.stamp and not b.pins and not b.n_children:
                self._return(b)

    def _return(self, block: Block) -> None:
        """An unpinned block became a leaf: it competes again, in its group's returned-heaps."""
        s = block.stamp
        sampled = block.queue == ST and self._st_sampled
        if sampled:
            if s > 0:
                return  # still in its list, where it is now a leaf
            s = block.stamp = -s  # parked by a scan: it competes again with its release stamp
        g = self._group(block)
        if self._rebin and (block.queue == CH or block.queue == AG):
            block.pdata = g  # a parked block takes its request's bin of the last rebinning only now
        heap = self._returned.get(g)
        if heap is None:
            heap = self._returned[g] = []
            self._list(g)  # evict's full refresh walks the groups that have a list
        heapq.heappush(heap, (s, block.key, block))
        if self._density and not sampled:
            newest = self._returned_new.get(g)
            if newest is None:
                newest = self._returned_new[g] = []
            heapq.heappush(newest, (-s, block.key, block))
        self._dirty.add(g)

    def on_hit(self, blocks: list[Block], now: float) -> None:
        qh = self._queue_hits
        for b in blocks:
            qh[b.queue] += 1
        if self._shape is not None:
            every = self._sample_every()
            for b in blocks:
                self._shape.ended(b, now, True, self._p_of, self._shape_of, every)

    def _compact(self) -> None:
        """Drop the dead entries of every list and returned-heap; live ones keep their order, so no decision changes.

        Scans drop dead entries from list heads; this bounds the ones behind long-lived heads. It runs after twice
        as many releases as entries survived the last compaction (at least ``_COMPACT_MIN``): amortised O(1) per
        released block, as each released block appends at most one entry.
        """
        self._flush()
        kept = 0
        for g, lst in self._lists.items():
            live = lst.live()
            self._lists[g] = _RecencyList((s for s, _ in live), (b for _, b in live))
            kept += len(live)
        for heaps, sign in ((self._returned, 1), (self._returned_new, -1)):
            for g, heap in heaps.items():
                valid = [e for e in heap if e[2].stamp == sign * e[0] and not e[2].pins and not e[2].n_children]
                heapq.heapify(valid)
                heaps[g] = valid
        self._compact_at = self._released + max(2 * kept, _COMPACT_MIN)

    # -- priority and eviction -----------------------------------------------------------------------------------
    def priority(self, b: Block, now: float) -> float:
        """``alpha_q * w_type`` times the block's ranking term at time ``now`` (lowest evicted first): its hit
        density under ``density`` (chat, agent, structural), else the paper's ``p_q / dt``."""
        dt = now - b.last_access
        if dt < self.min_dt:
            dt = self.min_dt
        _, kind, c1, c2, coef = self._constants(self._group(b))
        if kind == _DENSITY:  # the operations of _least, in its order, so that both give the same float
            score = coef * c1.density(c2, dt, self.horizon)
            if b.queue == ST and self.switches["position_decay"]:
                score *= 1.0 - b.pdata ** self._gamma
            return score
        return coef * self._rank(kind, c1, c2, dt, b)

    def _oldest_returned(self, g: int, want: int) -> list[Block]:
        """The ``want`` oldest evictable blocks of group ``g``'s returned-heap (stale entries dropped)."""
        heap = self._returned.get(g)
        while heap and (heap[0][2].stamp != heap[0][0] or heap[0][2].pins or heap[0][2].n_children):
            heapq.heappop(heap)
        if not heap:
            return []
        if want == 1:
            return [heap[0][2]]
        # pop, then push back: O(want log n), where nsmallest would read the whole heap
        taken = []
        while heap and len(taken) < want:
            e = heapq.heappop(heap)
            if e[2].stamp == e[0] and not e[2].pins and not e[2].n_children:
                taken.append(e)
        for e in taken:
            heapq.heappush(heap, e)
        return [e[2] for e in taken]

    def _structural_candidates(self, g: int, want: int) -> list[Block]:
        """Up to ``want`` leaves from the head of a structural list, parking the inner nodes met, plus the
        ``want`` oldest returned blocks.

        The sample is the one the original scan took: it walked from the head counting leaves and, at an inner
        node, parked it and restarted from the head, counting the leaves before it once more; it stopped when its
        count reached ``want``. So after parkings fewer than ``want`` distinct leaves may compete. One walk
        reproduces it, with ``counted`` the original scan's count. A parked block's stamp is negated (dead entry,
        and on_leaf knows it from a structural block still listed); the walk drops it and the dead entries.
        """
        lst = self._lists[g]
        stamps, members = lst.stamps, lst.blocks
        leaves: list[Block] = []
        counted = 0
        while stamps:
            s, b = stamps.popleft(), members.popleft()
            if b.stamp != s or b.pins:
                continue
            if b.n_children:
                b.stamp = -s
                if counted + len(leaves) >= want:
                    break
                counted += len(leaves)
                continue
            leaves.append(b)
            counted += 1
            if counted >= want:
                break
        stamps.extendleft([b.stamp for b in reversed(leaves)])  # the leaves walked over go back in front
        members.extendleft(reversed(leaves))
        if self._density:  # the hit density may rise with idle time: the newest leaf competes too
            for s, b in zip(reversed(stamps), reversed(members), strict=True):
                if b.stamp == s and not b.pins:
                    if not b.n_children and b not in leaves:
                        leaves.append(b)
                    break
        return leaves + self._oldest_returned(g, want)

    def _newest(self, g: int, lst: _RecencyList) -> Block | None:
        """Group ``g``'s most recently released evictable block: the newer of its list's tail and the top of its
        newest-first returned-heap (dead entries dropped from both)."""
        best = _live_end(lst, -1)
        heap = self._returned_new.get(g)
        while heap:
            s, _, b = heap[0]
            if b.stamp == -s and not b.pins and not b.n_children:
                if best is None or b.stamp > best.stamp:
                    best = b
                break
            heapq.heappop(heap)
        return best

    def _best(self, g: int, now: float) -> tuple[int, float, int, int, Block] | None:
        """Group ``g``'s candidate of least (PE flag, priority, release stamp) at ``now``, as that key + (g, it).

        One flat tuple: ``evict`` takes the least over the groups, and release stamps are unique, so tuples
        compare on the key alone (the block is never compared). The candidates are kept in ``_held``."""
        cands = self._candidates(g)
        self._held[g] = [(b, b.stamp) for b in cands]
        return self._least(g, cands, now)

    def _candidates(self, g: int) -> list[Block]:
        """The blocks of group ``g`` that can hold its least key (see on_release and _structural_candidates)."""
        kind = (self._consts.get(g) or self._constants(g))[1]
        if self._st_sampled and _queue_of(g) == ST:
            cands = self._structural_candidates(g, self.sample)
        else:
            # A chat, agent or PE group's oldest evictable block is the older of its list head and its heap top
            # (see on_release); both compete, as the first leaf of a list and its heap top always did. Under
            # ``density`` the newest competes too: the density rises, then falls, with idle time (survival.py).
            lst = self._lists[g]
            b = _live_end(lst, 0)
            cands = [] if b is None else [b]
            heap = self._returned.get(g)
            while heap:
                s, _, b = heap[0]
                if b.stamp == s and not b.pins and not b.n_children:
                    cands.append(b)
                    break
                heapq.heappop(heap)
            if kind == _DENSITY and cands:
                b = self._newest(g, lst)
                if b is not None and b not in cands:
                    cands.append(b)
        return cands

    def _least(self, g: int, cands: list[Block], now: float) -> tuple[int, float, int, int, Block] | None:
        """The least key of ``cands`` (blocks of group ``g``) at ``now``."""
        flag, kind, c1, c2, coef = self._consts.get(g) or self._constants(g)
        min_dt = self.min_dt
        best = None
        # Blocks a request released together share their idle time, so one density evaluation per (group, release
        # time) serves the whole run of evictions at this instant (structural blocks then weigh it by offset).
        memo = self._memo if kind == _DENSITY else None
        decay = self._gamma if self._decay and _queue_of(g) == ST else None
        for b in cands:  # the priority() formula, with the group's constants
            if memo is not None:
                at = (g, b.last_access)
                score = memo.get(at)
                if score is None:
                    dt = now - b.last_access
                    score = memo[at] = coef * c1.density(c2, dt if dt > min_dt else min_dt, self.horizon)
                if decay is not None:
                    score *= 1.0 - b.pdata ** decay
            else:
                dt = now - b.last_access
                if dt < min_dt:
                    dt = min_dt
                score = coef * self._rank(kind, c1, c2, dt, b)
            key = (flag, score, b.stamp, g, b)
            if best is None or key < best:
                best = key
        return best

    def clock(self, now: float) -> float:
        """The ranking's clock at ``now``: rounded up to a multiple of ``clock_step`` horizons (CLOCK_STEP; not before
        ``now`` but by the division's rounding, and a score clamps idle times at ``min_dt`` anyway), or ``now`` itself
        with ``clock_step = 0``."""
        step = self.clock_step * self.horizon
        if 0.0 < step < math.inf:
            return float(math.ceil(now / step)) * step
        return now

    def evict(self, now: float) -> Block | None:
        self._evict_now = now  # gap_select: the victim's idle time ends here (the ranking reads the clock's step)
        now = self.clock(now)
        up = self._next_up
        if up is not None:
            self._next_up = None
            # The last victim's parent, released right after it into its group (same constants, same idle time,
            # hence the same score) and a leaf now: its key is the last victim's but for the next stamp, and every
            # other candidate's key was above the last victim's with a stamp that is not this one, so it is the
            # least key: the victim a scan would choose, without the scan. (A structural group's candidates are a
            # sample: there the parent's key is at most that of any block its scan could sample.) A clock change
            # voids _cand_now; an acquire, a release or a structural arrival (on_request) sets _stale.
            if self._cand_now == now and not self._stale and up.stamp == self._next_stamp and not up.pins \
                    and not up.n_children:
                if self._deferred is up:
                    self._deferred = None
                return self._take(up, up.stamp)
        self._flush()
        cand = self._cand
        if self._cand_now != now or self._stale:
            # A new instant (every key moves) or acquires and releases since the last eviction (candidates may have
            # been pinned, re-released or joined): groups something was added to, or whose candidates changed, are
            # scanned again; the others keep their candidates, rescored at a new instant.
            rescore = self._cand_now != now
            if rescore and self._memo_now != now:
                self._memo.clear()
                self._memo_now = now
            dirty, held = self._dirty, self._held
            for g in self._lists:
                cb = held.get(g)
                # A structural scan parks the inner nodes it meets, so a second scan samples further: it runs at
                # every instant, as it always did.
                if g in dirty or cb is None or (rescore and self._st_sampled and _queue_of(g) == ST) \
                        or _moved(cb):
                    best = self._best(g, now)
                elif not cb:
                    continue  # no candidate then, so none now: a block joining it would have made it dirty
                elif rescore:
                    best = self._least(g, [b for b, _ in cb], now)
                else:
                    continue
                if best is None:
                    cand.pop(g, None)
                else:
                    cand[g] = best
            self._cand_now = now
            self._stale = False
        else:
            for g in self._dirty:
                best = self._best(g, now)
                if best is None:
                    cand.pop(g, None)
                else:
                    cand[g] = best
        self._dirty.clear()
        if not cand:
            return None
        best = min(cand.values())
        g, victim = best[3], best[4]
        del cand[g]
        self._dirty.add(g)
        return self._take(victim, victim.stamp)

    def _take(self, victim: Block, stamp: int) -> Block:
        """Forget the victim (its list or heap entry is dead now) and note its parent as the likely next one."""
        if self._shape is not None:  # (before rebin forgets its releasing request, which its bin needs)
            self._shape.ended(victim, self._evict_now, False, self._p_of, self._shape_of, self._sample_every())
        self._occupancy[victim.queue] -= 1
        victim.stamp = 0
        group = victim.pdata
        if self._rebin:
            # the victim's group now: a parent the shortcut took never returned, so its pdata may predate the last
            # rebinning (comparing that would miss every other parent of a chain, and each miss costs a scan)
            group = self._group(victim)
            self._released_by.pop(victim, None)
        parent = victim.parent
        if parent is not None and parent.queue == victim.queue:
            q = victim.queue
            if q == CH or q == AG:  # their group is in pdata, set at release (rebin: a parked one's when it returns)
                same = (self._group(parent) if self._rebin else parent.pdata) == group
            else:  # a sampled structural group weighs each block's offset: its parent scores apart
                same = not (q == ST and self._st_sampled) and (not self._typed or parent.type == victim.type)
            if same:
                self._next_up = parent
                self._next_stamp = stamp + 1
        return victim

    def _evictable(self) -> list[Block]:
        self._flush()
        listed = [b for lst in self._lists.values() for _, b in lst.live() if not b.n_children]
        returned = [e[2] for heap in self._returned.values() for e in heap
                    if e[2].stamp == e[0] and not e[2].pins and not e[2].n_children]
        return listed + returned

    def exact_victim(self, now: float) -> Block | None:
        """The exact argmin over every evictable block (no side effects; O(cache), for tests)."""
        multi = self.switches["multi_queue"]
        cands = self._evictable()
        if not cands:
            return None
        now = self.clock(now)
        return min(cands, key=lambda b: (0 if (multi and b.queue == PE) else 1, self.priority(b, now), b.stamp))

    # -- statistics for the learners -----------------------------------------------------------------------------
    def reset_window(self) -> None:
        """Start a window: the counts the learners read start over."""
        self._flush()
        self._queue_hits = [0] * N_QUEUES
        self.arrivals.reset_window()

    def _refit(self, now: float) -> None:
        """Every ``REFIT_EVERY`` arrivals, whatever the replay's window: the cache's turnover time is re-estimated
        (the continuation model, its soft labels and correction, were refitted by ``arrivals``)."""
        elapsed = now - self._window_t0
        if elapsed > 0 and self._window_inserted:
            rate = self._window_inserted / elapsed
            self._ins_rate = rate if self._ins_rate is None else 0.7 * self._ins_rate + 0.3 * rate
            self._window_inserted = 0
            self._window_t0 = now
        if self._ins_rate:
            self._horizon = self.cache.capacity / self._ins_rate
        if self._rebin and self.arrivals.arrivals // REFIT_EVERY % self.rebin_every == 0 and self._model_moved():
            self._rebin_blocks()
        if self._empirical:
            self._empirical_gaps()
        shape = self._shape
        if shape is not None and shape.choose(now, self._p_of, self._shape_of, self._sample_every(),
                                              census_on(shape.evicted, self.cache.capacity, self.census)):
            self._read_shapes()
        self._changed()

    def _read_shapes(self) -> None:
        """gap_select: each queue's density reads the shape chosen for it (gap_shape.py): the log-normal of its
        parameters or the exponential of the same mean."""
        for q, exponential in self._shape.exponential.items():
            self._gaps[q] = ExponentialGaps(self._exp_mean[q]) if exponential else LognormalGaps(*self._ln[q])

    def _sample_every(self) -> int:
        """gap_select: its sampling step (gap_shape.idle_every): the blocks it follows from their release to their
        hit or eviction are those whose release stamp is a multiple of it, each counted that many times."""
        return idle_every(self.cache.capacity, self.idle_sample)

    def _p_of(self, b: Block) -> float:
        """gap_select: the continuation probability block ``b``'s score reads now (its group's bin; the shared
        prefixes' reuse rate for a structural block)."""
        return self.arrivals.p_structural if b.queue == ST else slot_p(self._group(b) % VALUE_STRIDE // _SLOT)

    def _shape_of(self, q: int) -> tuple[float, float, float]:
        """gap_select: queue ``q``'s log-normal ``mu, sigma`` and their mean."""
        mu, sigma = self._ln[q]
        return mu, sigma, self._exp_mean[q]

    def _empirical_gaps(self, used: tuple[int, int] | None = None, prior: Any = None) -> None:
        """``empirical_gaps`` or ``gap_mixture``: the chat and agent queues' gap distributions from the gaps completed
        so far (the first ``used`` of each queue's, when given: as an exported state had them), with the learners'
        current log-normal as the prior (and in its place where the mixture is not chosen); ``prior``: a state's
        (EmpiricalShapes.priors)."""
        for q, shape in self._shapes.update(self.arrivals.raw_gaps, self._params, used, prior).items():
            self._gaps[q] = shape if shape is not None else LognormalGaps(*self._ln[q])

    def _model_moved(self) -> bool:
        """``rebin``: whether the continuation model has moved by ``rebin_move`` since the last rebinning
        (arrivals.model_moved); if so, this is the last rebinning's model from now on."""
        model = self.arrivals.model
        rates, beta = model.rates, model.beta.copy()
        if not model_moved(rates, beta, self._rebin_last, self.rebin_move):
            return False
        self._rebin_last = (rates, beta)
        return True

    def _rebin_blocks(self) -> None:
        """``rebin``: every evictable chat or agent block moves to the continuation bin of its releasing request as the
        model sees that request now (the model learns as the replay goes, and a bin chosen at a request's arrival
        stays what the model then knew); parked blocks take theirs when they return (_group). The lists are rebuilt
        in release order, so each group's order stays exact."""
        self._flush()
        self._next_up = None
        by = self._released_by
        if not by:
            return
        reqs = np.unique(np.fromiter(by.values(), dtype=np.int64, count=len(by)))
        reqs = reqs[reqs >= 0]
        p = self.arrivals.model.p_many(reqs)
        self._bin_now = dict(zip(reqs.tolist(), [slot_of(x) for x in p.tolist()], strict=True))
        temporal = sorted((b for b in self._evictable() if b.queue == CH or b.queue == AG), key=lambda b: b.stamp)
        for g in [g for g in self._lists if _queue_of(g) in (CH, AG)]:
            for held in (self._lists, self._returned, self._returned_new, self._cand, self._held):
                held.pop(g, None)
        for b in temporal:  # in release order: each group's list is rebuilt in order
            b.pdata = g = self._group(b)
            lst = self._list(g)
            lst.stamps.append(b.stamp)
            lst.blocks.append(b)
            self._dirty.add(g)
        self._stale = True

    def _changed(self) -> None:
        """Ranking constants moved: every group's constants and scores are computed again."""
        self._consts.clear()
        self._cand_now = None
        self._memo_now = None

    @property
    def horizon(self) -> float:
        """The hit density's horizon: the cache's turnover time (s), or the chat queue's mean gap before any
        measurement."""
        return self._horizon if self._horizon is not None else self._exp_mean[CH]

    def occupancy_by_queue(self) -> dict[int, int]:
        return {q: n for q, n in enumerate(self._occupancy) if n}

    def window_stats(self) -> dict[str, Any]:
        shape = self._shape
        return window_stats(self.arrivals, self._queue_hits, self._occupancy, self.params,
                            self.horizon if self._density else None,
                            None if shape is None else [int(shape.exponential[q]) for q in shape.queues])

    # -- the state contract (sae_env.state) ----------------------------------------------------------------
    # Per block: its release stamp, where it waits (1: its group's recency list, 2: its group's returned-heaps,
    # 0: pinned, or parked), and its group (chat and agent blocks, from their last release; -1 none). The lists and
    # heaps are those sets in stamp order; the cached candidates are not state (every group is scanned afresh
    # after an import, which chooses what they would).
    def export_state(self, index: dict[int, int]) -> dict[str, Any]:
        self._flush()
        blocks = self.cache.blocks.values()
        where = dict.fromkeys((b.key for lst in self._lists.values() for _, b in lst.live()
                               if not b.n_children or (b.queue == ST and self._st_sampled)), 1)
        where.update(dict.fromkeys((e[2].key for heap in self._returned.values() for e in heap
                                    if e[2].stamp == e[0] and not e[2].pins and not e[2].n_children), 2))
        temporal = (CH, AG)

        def pos(b: Block | None) -> int:
            return -1 if b is None or b.key not in index else index[b.key]

        def opt(x: float | None) -> float:
            return math.nan if x is None else x

        inflight = self._inflight
        out = {"stamp": block_array(blocks, index, lambda b: b.stamp),
               "where": block_array(blocks, index, lambda b: where.get(b.key, 0)),
               "group": block_array(blocks, index, lambda b: b.pdata if b.queue in temporal else None, default=-1),
               "released": self._released, "next_up": pos(self._next_up),
               "next_stamp": self._next_stamp, "deferred": pos(self._deferred), "stale": int(self._stale),
               "cand_now": opt(self._cand_now), "now": self._now, "prompt_queue": self._prompt_queue,
               "output_queue": self._output_queue, "slot": self._slot, "n_prompt": self._n_prompt,
               "output_reasoning": int(self._output_reasoning), "occupancy": np.array(self._occupancy),
               "queue_hits": np.array(self._queue_hits), "horizon": opt(self._horizon),
               "ins_rate": opt(self._ins_rate), "window_inserted": self._window_inserted,
               "window_t0": opt(self._window_t0),
               "inflight": np.fromiter(inflight.keys(), dtype=np.int64, count=len(inflight)),
               "inflight_queue": np.array([q for q, _ in inflight.values()], dtype=np.int64),
               "inflight_slot": np.array([s for _, s in inflight.values()], dtype=np.int64),
               **self.arrivals.export_state()}
        if self._rebin:
            by, bins = self._released_by, self._bin_now
            out["released_by"] = block_array(blocks, index, by.get, default=-1)
            out["rebin_requests"] = np.fromiter(bins.keys(), dtype=np.int64, count=len(bins))
            out["rebin_bins"] = np.fromiter(bins.values(), dtype=np.int64, count=len(bins))
            out.update(rebin_last_state(self._rebin_last))  # the model at the last rebinning
        if self.switches["position_decay"]:  # a structural block's relative offset (unused otherwise)
            out["offset"] = block_array(blocks, index, lambda b: b.pdata if b.queue == ST else None, np.float64)
        if self._shape is not None:  # gap_select: each idle block's release, the sums, the choices
            out.update(self._shape.export_state(blocks, index))
        if self._empirical:  # the gaps the ranking's distributions were built from (each queue's first n)
            out["empirical_used"] = np.array(self._shapes.used, dtype=np.int64)
            out["mixture_prior"] = self._shapes.priors  # and the prior each was built with
        return out

    def import_state(self, state: dict[str, Any], blocks: list[Block]) -> None:
        def opt(x: float) -> float | None:
            return None if math.isnan(x) else float(x)

        offsets = state["offset"].tolist() if "offset" in state else [None] * len(blocks)
        if self._rebin:  # before _group places any block
            self._released_by = {b: i for b, i in zip(blocks, state["released_by"].tolist(), strict=True) if i >= 0}
            self._bin_now = dict(zip(state["rebin_requests"].tolist(), state["rebin_bins"].tolist(), strict=True))
            self._rebin_last = rebin_last(state)
        for b, stamp, g, x in zip(blocks, state["stamp"].tolist(), state["group"].tolist(), offsets, strict=True):
            b.stamp = stamp
            b.pdata = (g if g >= 0 else None) if b.queue in (CH, AG) else (x if b.queue == ST else None)
        self._lists, self._returned, self._returned_new = {}, {}, {}
        where = state["where"].tolist()
        listed = sorted((b for b, w in zip(blocks, where, strict=True) if w == 1), key=lambda b: b.stamp)
        for b in listed:
            lst = self._list(self._group(b))
            lst.stamps.append(b.stamp)
            lst.blocks.append(b)
        for b, w in zip(blocks, where, strict=True):
            if w == 2:  # as _return pushes it (a parked structural block has its stamp back already)
                g = self._group(b)
                self._list(g)
                heapq.heappush(self._returned.setdefault(g, []), (b.stamp, b.key, b))
                if self._density and not (b.queue == ST and self._st_sampled):
                    heapq.heappush(self._returned_new.setdefault(g, []), (-b.stamp, b.key, b))
        self._dirty = set(self._lists)
        if self._shape is not None:
            self._shape.import_state(state, blocks)
            self._read_shapes()
        self._cand, self._held, self._memo, self._consts = {}, {}, {}, {}
        self._memo_now = None
        self._released = int(state["released"])
        self._compact_at = self._released + _COMPACT_MIN  # compaction changes no decision: not part of the state
        self._next_up = blocks[state["next_up"]] if state["next_up"] >= 0 else None
        self._next_stamp = int(state["next_stamp"])
        self._deferred = blocks[state["deferred"]] if state["deferred"] >= 0 else None
        self._stale, self._cand_now = bool(state["stale"]), opt(state["cand_now"])
        self._now = float(state["now"])
        self._prompt_queue, self._output_queue = int(state["prompt_queue"]), int(state["output_queue"])
        self._slot, self._n_prompt = int(state["slot"]), int(state["n_prompt"])
        self._output_reasoning = bool(state["output_reasoning"])
        self._occupancy, self._queue_hits = state["occupancy"].tolist(), state["queue_hits"].tolist()
        self._horizon, self._ins_rate = opt(state["horizon"]), opt(state["ins_rate"])
        self._window_inserted, self._window_t0 = int(state["window_inserted"]), opt(state["window_t0"])
        self._inflight = {i: (q, s) for i, q, s in zip(state["inflight"].tolist(), state["inflight_queue"].tolist(),
                                                       state["inflight_slot"].tolist(), strict=True)}
        self.arrivals.import_state(state)
        if self._empirical:  # the raw gaps are the state's now: counted again
            self._shapes = EmpiricalShapes(mixture=self.switches["gap_mixture"], growth=self.refit_growth)
            used, prior = state.get("empirical_used"), state.get("mixture_prior")
            self._empirical_gaps(None if used is None else (int(used[0]), int(used[1])), prior)

    def check_invariants(self) -> None:
        """Every unpinned block is in exactly one place: live in its group's list, valid in its group's
        returned-heap, or parked (an inner node: a structural one with its stamp negated by a scan, any other one
        unlisted since its release). Under gap_select the idle blocks are the unpinned ones, idle since a release."""
        self._flush()
        blocks = self.cache.blocks
        if self._shape is not None:
            every = self._sample_every()
            unpinned = {b for b in blocks.values() if not b.pins and not abs(b.stamp) % every}
            if set(self._shape.idle) != unpinned:
                raise RuntimeError("saecache: gap_select's idle blocks are not the cache's unpinned blocks in its "
                                   "sample")
        placed: set[int] = set()

        def place(g: int, b: Block, where: str) -> None:
            if self._group(b) != g or blocks.get(b.key) is not b:
                raise RuntimeError(f"saecache: {b!r} in the {where} of group {g}")
            if b.key in placed:
                raise RuntimeError(f"saecache: {b!r} is listed twice")
            placed.add(b.key)

        for g, lst in self._lists.items():
            if len(lst.stamps) != len(lst.blocks):
                raise RuntimeError(f"saecache: the list of group {g} lost an entry's stamp or block")
            for _, b in lst.live():
                if b.n_children and not (b.queue == ST and self._st_sampled):
                    raise RuntimeError(f"saecache: {b!r} is listed but not a leaf")
                place(g, b, "list")
        for g, heap in self._returned.items():
            for s, _, b in heap:
                if b.stamp == s and not b.pins and not b.n_children:
                    place(g, b, "returned-heap")
        for g, heap in self._returned_new.items():
            for s, _, b in heap:
                if b.stamp == -s and not b.pins and not b.n_children and (b.key not in placed
                                                                          or self._group(b) != g):
                    raise RuntimeError(f"saecache: {b!r} is in the newest-first heap of group {g} only")
        stamps: set[int] = set()
        for k, b in blocks.items():
            if b.pins:
                continue
            if k not in placed:
                if not b.n_children:
                    raise RuntimeError(f"saecache: evictable {b!r} is in no list")
                if (b.stamp < 0) != (b.queue == ST and self._st_sampled):
                    raise RuntimeError(f"saecache: parked {b!r} has stamp {b.stamp}")
            if not b.stamp or abs(b.stamp) in stamps:
                raise RuntimeError(f"saecache: unpinned {b!r} has stamp {b.stamp}, not a unique release stamp")
            stamps.add(abs(b.stamp))
        occ = [0] * N_QUEUES
        for b in blocks.values():
            occ[b.queue] += 1
        if occ != self._occupancy:
            raise RuntimeError(f"saecache: occupancy {self._occupancy} != {occ}")


def _lognormal_params(params: dict[str, float]) -> dict[int, tuple[float, float]]:
    return {CH: (params["mu_chat"], params["sigma_chat"]), AG: (params["mu_agent"], params["sigma_agent"]),
            ST: (params["mu_structural"], params["sigma_structural"])}


class EmpiricalShapes:
    """``empirical_gaps`` or ``gap_mixture``: the chat and agent queues' gap distributions from the gaps the arrivals
    completed so far. ``empirical_gaps``: survival.EmpiricalGaps, with the log-normal of the current parameters as
    the prior, rebuilt when its gaps or its prior moved (the same floats otherwise), from the gaps counted on the grid
    as they came. ``gap_mixture``: survival.fit_gap_mixture on the first ``mixture_gaps_used(n, growth)`` gaps, refitted
    when that count moves; None where BIC keeps one log-normal (the learners' current one ranks then). One for the
    policy, one for the compiled twin. The raw gaps must only grow between calls; a caller whose raw gaps are replaced
    (an imported state) starts a new one."""

    def __init__(self, mixture: bool = False, growth: float = 0.5) -> None:
        self.mixture, self.growth = mixture, growth
        self._built: dict[int, GridGaps | None] = {}
        self._key: dict[int, tuple[int, float, float]] = {}  # what each was built from: (gaps, mu, sigma)
        self._counts: dict[int, GapCounts] = {}

    def update(self, raw: dict[int, Any], params: dict[str, float], used: tuple[int, int] | None = None,
               prior: Any = None, upto: tuple[int, int] | None = None) -> dict[int, GridGaps | None]:
        """The distributions of the chat and agent queues from their raw gaps (``Arrivals.raw_gaps``: all of them, or
        each queue's first ``upto``, as they were at an earlier arrival; or its first ``used``: the counts a state's
        distributions rested on) under ``params``' log-normal constants (their prior; a state's mixtures' own
        ``prior`` when given, [2, 2] as :attr:`priors` has them)."""
        ln = _lognormal_params(params)
        if prior is not None:
            prior = [tuple(row) for row in np.asarray(prior, dtype=np.float64).tolist()]
        for k, q in enumerate((CH, AG)):
            n = (len(raw[q]) if upto is None else upto[k]) if used is None else used[k]
            if self.mixture:  # refitted only when its count of gaps moves, under the prior of that moment
                if used is None:
                    n = mixture_gaps_used(n, self.growth)
                refit = self._key.get(q, (None,))[0] != n
                key = (n, *(ln[q] if prior is None else prior[k])) if refit else self._key[q]
            else:
                key = (n, *ln[q])
                refit = self._key.get(q) != key
            if refit:
                gaps = np.frombuffer(raw[q], dtype=np.float64)[:n] if n else np.zeros(0)
                counts = self._counts.get(q)
                if counts is None or counts.n > gaps.size:
                    counts = self._counts[q] = GapCounts()
                counts.extend_to(gaps)
                self._built[q] = (fit_gap_mixture(counts, key[1], key[2], EMPIRICAL_PRIOR) if self.mixture
                                  else EmpiricalGaps(counts, key[1], key[2], EMPIRICAL_PRIOR))
                self._key[q] = key
        return dict(self._built)

    @property
    def used(self) -> tuple[int, int]:
        """The gaps the chat and agent distributions rest on."""
        return (self._key[CH][0], self._key[AG][0]) if self._key else (0, 0)

    @property
    def priors(self) -> np.ndarray:
        """The prior ``(mu, sigma)`` each queue's distribution was built with, chat then agent (float64 [2, 2])."""
        return np.array([self._key[CH][1:], self._key[AG][1:]], dtype=np.float64)


def gap_models(params: dict[str, float], lognormal: bool = True) -> dict[int, LognormalGaps]:
    """The gap distribution of the chat, agent and structural queues for SAECache's parameters (exponential with
    the log-normal's mean when ``lognormal`` is off)."""
    return {q: LognormalGaps(mu, s) if lognormal else ExponentialGaps(math.exp(mu + s * s / 2))
            for q, (mu, s) in _lognormal_params(params).items()}


def window_stats(arrivals: Arrivals, queue_hits: list[int], occupancy: list[int], params: dict[str, float],
                 horizon: float | None, exponential: list[int] | None = None) -> dict[str, Any]:
    """SAECache's window statistics (what the online learners read), on either engine; ``horizon`` under
    ``density`` only; ``exponential`` under ``gap_select`` only: 1 where the chat, agent, structural queue reads the
    exponential at the window's end."""
    out = {"queue_hits": list(queue_hits), "queue_occupancy": list(occupancy), "params": params}
    if horizon is not None:
        out["horizon_s"] = horizon
    if exponential is not None:
        out["gap_exponential"] = list(exponential)
    return arrivals.window_stats(out)


# The paper's method: its ranking and routing, and its three multiplicative mechanisms.
PAPER = {"continuation": False, "density": False, "type_weights": True, "adaptive_alpha": True, "position_decay": True,
         "clock_step": 0.0}


class SAECachePaperPolicy(SAECachePolicy):
    """SAECache as the paper describes it (``PAPER``): the same options, other defaults."""

    name = "saecache-paper"

    def __init__(self, **options: Any) -> None:
        super().__init__(**{**PAPER, **options})

    __init__.__signature__ = inspect.signature(SAECachePolicy.__init__)  # its options, for callers that look


def _survival(kind: int, c1: float, c2: float, dt: float, x: float | None) -> float:
    """``p_q(b)`` after ``dt`` idle seconds, from a group's constants (see ``SAECachePolicy._constants``)."""
    if kind == _LOGNORMAL:  # c1 = mu, c2 = sigma * sqrt(2)
        return 0.5 * math.erfc((math.log(dt) - c1) / c2)
    if kind == _EXPONENTIAL:  # c1 = the mean
        return math.exp(-dt / c1)
    if kind == _POSITION:  # c1 = gamma, x = the block's relative offset
        return 1.0 - x ** c1
    return 1.0


def _moved(held: list[tuple[Block, int]]) -> bool:
    """Whether a group's held candidates changed since they were chosen (re-released, pinned or given a child)."""
    for b, s in held:  # a loop, not any() over a generator: evict asks this of every group at every instant
        if b.stamp != s or b.pins or b.n_children:
            return True
    return False


def _live_end(lst: _RecencyList, end: int) -> Block | None:
    """The first live entry of a (non-structural) recency list from its head (``end=0``) or its tail (``-1``),
    dropping the dead entries on the way; live there means an unpinned leaf."""
    stamps, members = lst.stamps, lst.blocks
    drop_s, drop_m = (stamps.popleft, members.popleft) if end == 0 else (stamps.pop, members.pop)
    while stamps:
        b = members[end]
        if b.stamp == stamps[end] and not b.pins:
            return b
        drop_s()
        drop_m()
    return None
