"""numba, when it is installed, and the compiled hook interface: a policy's compiled hooks are chosen by the type
of its state.

A compiled policy keeps its state in a :class:`typing.NamedTuple` of arrays (its *state class*) and implements the
hooks below for that class with :func:`implements`. The request loop (:mod:`sae_env.fast_engine.loop`) is written
once, as *templates* that call ``on_insert(ps, c, s, now)`` and so on by name; :func:`kernel` compiles it for one
state class with that class's hooks in place, so every policy gets its own machine code with its hooks inlined (no
call through a pointer, no branch on a policy code). This is the compiled counterpart of
:class:`~sae_env.policies.base.EvictionPolicy`: the same hooks, over slots (array rows) instead of blocks.

(numba's ``overload`` could pick the hooks by type too, but its inlining of typed code miscompiled a hook with a
loop here (numba 0.68: "variable ... is not in scope"), and without inlining every hook call cost a reference
count per array: the lru loop ran at half speed. Whole-function inlining before typing, as here, has neither
problem.)

Hooks (``ps``: the policy's state, ``c``: the cache core (:class:`~sae_env.fast_engine.loop.Core`), ``path[i0:i1]``
a run of a request's slots, in path order):

=========================================  ======================================================================
``on_request(ps, c, j, now)``              request ``j`` arrives (before its lookup)
``on_complete(ps, c, j, now)``             request ``j`` finished decoding; its outputs are inserted next
``on_acquire(ps, c, path, i0, i1)``        these slots' pins went 0 -> 1
``on_hit(ps, c, path, i0, i1, now)``       the request hit these slots
``on_insert(ps, c, s, now)``               slot ``s`` was filled (pinned by the inserting request)
``on_release(ps, c, path, i0, i1, now)``   these slots' pins went 1 -> 0; released deepest first, i.e. from
                                           ``path[i1 - 1]`` down to ``path[i0]``
``on_leaf(ps, c, s)``                      slot ``s`` lost its last cached child
``evict(ps, c, now) -> slot``              choose an unpinned leaf, forget it, return its slot (-1: none)
=========================================  ======================================================================

A hook a policy does not implement is a no-op (``evict`` must be implemented).
"""

from __future__ import annotations

import hashlib
import re
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["AVAILABLE", "HOOKS", "borrow", "cache_stamp", "implements", "inline", "jit", "kernel", "package_stamp",
           "rebind", "stamped_files", "template"]

try:  # an optional dependency: the replay falls back to the Python engine without it
    import numba

    AVAILABLE = True
    # No C-callable wrapper: nothing here takes a kernel's address, and the wrapper is code that every process
    # loads from the disk cache before a kernel's first call (LLVM parses it: 270-430 instructions a kernel).
    jit = numba.njit(cache=True, nogil=True, boundscheck=False, no_cfunc_wrapper=True)
    # Helpers are inlined into the kernels: a call that passes arrays costs reference-count updates, which
    # measured here tripled the cost of an LRU update.
    inline = numba.njit(inline="always", boundscheck=False)
except ImportError:  # pragma: no cover - exercised only where numba is not installed
    AVAILABLE = False

    def jit(f):
        return f

    inline = jit

    def borrow(state):
        return state

_PACKAGE = Path(__file__).resolve().parent

if AVAILABLE:
    from numba.core import cgutils
    from numba.core import types as nbtypes
    from numba.extending import intrinsic

    def _borrowed(context, builder, ty, value):
        """``value`` (of numba type ``ty``) with every array in it replaced by a view that owns no reference."""
        if isinstance(ty, nbtypes.Array):
            src = context.make_array(ty)(context, builder, value)
            dst = context.make_array(ty)(context, builder)
            for field in ("nitems", "itemsize", "data", "shape", "strides"):
                setattr(dst, field, getattr(src, field))
            dst.meminfo = cgutils.get_null_value(dst.meminfo.type)
            dst.parent = cgutils.get_null_value(dst.parent.type)
            return dst._getvalue()
        if isinstance(ty, nbtypes.BaseTuple):
            out = cgutils.get_null_value(context.get_value_type(ty))
            for i, t in enumerate(ty.types):
                out = builder.insert_value(out, _borrowed(context, builder, t, builder.extract_value(value, i)), i)
            return out
        return value

    @intrinsic
    def borrow(typingctx, state):
        """The tuple of arrays ``state`` (nested tuples too), its arrays as borrowed views: no reference count.

        Every read of an array field of a tuple (``c.rec``) is a new reference to it, an atomic increment and a
        decrement later; across the hundreds of field reads of a request that measured 4-5x the cost of LRU's
        per-request work (and they keep LLVM from optimising the loop). A kernel takes its arguments' arrays as
        borrowed views once at entry: they stay alive because the caller holds the tuples for the whole call, and
        a borrowed view must never be returned or stored beyond the call (the kernels return plain numbers)."""

        def codegen(context, builder, sig, args):
            return _borrowed(context, builder, sig.args[0], args[0])

        return state(state), codegen


# ``from sae_env.x.y import ...`` / ``import sae_env.x.y``: the modules of the project a source file imports from
_IMPORT = re.compile(r"^\s*(?:from\s+(sae_env(?:\.\w+)*)\s+import\b|import\s+(sae_env(?:\.\w+)*))", re.M)


def stamped_files(package: Path = _PACKAGE) -> list[Path]:
    """Every source file of ``package``, then every module of the project its files import from.

    The imported modules count because a kernel reads a global as a constant frozen into its machine code: a value
    imported from another module (``LOGIT_BIN`` from :mod:`sae_env.policies.arrivals`, a ``TokenType``) must
    invalidate the kernels when it changes, or they run with the old one (a changed bin width wrote past the end of
    an array). Only direct imports count: a constant a module re-exports from a third one is covered by the third's
    source only if the package imports that one too."""
    root = package.parent.parent  # the folder that holds the project's top-level package
    own = sorted(package.glob("*.py"))
    imported: set[Path] = set()
    for f in own:
        for a, b in _IMPORT.findall(f.read_text()):
            parts = (a or b).split(".")
            for candidate in (root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py")):
                if candidate.is_file():
                    if candidate.resolve().parent != package.resolve():
                        imported.add(candidate.resolve())
                    break
    return own + sorted(imported)


def package_stamp(package: Path = _PACKAGE) -> str:
    """A digest of :func:`stamped_files`: their paths (below the project's folder) and contents."""
    root = package.parent.parent.resolve()
    h = hashlib.sha256()
    for f in stamped_files(package):
        f = f.resolve()
        h.update(str(f.relative_to(root) if f.is_relative_to(root) else f.name).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


# numba settings that change the machine code a kernel compiles to but not numba's own cache key (which holds the
# signature, the CPU and its features): a kernel compiled under NUMBA_ENABLE_PROFILING=1 is ten times larger, and
# once cached it made every later process's first replay 9x slower, decision times included.
_CODEGEN_SETTINGS = ("OPT", "DEBUGINFO_DEFAULT", "ENABLE_PROFILING", "BOUNDSCHECK", "LOOP_VECTORIZE", "SLP_VECTORIZE")


def cache_stamp(package: Path = _PACKAGE) -> str:
    """What a cached kernel of ``package`` is checked against: :func:`package_stamp` and the numba settings its
    machine code depends on (``_CODEGEN_SETTINGS``). A kernel cached under other settings is stale: it compiles
    again, and the cache keeps the latest."""
    from numba.core import config

    settings = ",".join(f"{name}={getattr(config, name, None)}" for name in _CODEGEN_SETTINGS)
    return f"{package_stamp(package)};{settings}"


def _stamp_the_whole_package(stamp: str) -> None:
    """numba checks a cached kernel against its own source file only, but a kernel here inlines hooks from the
    other modules of the package and reads constants imported from the project's other modules: a changed hook or
    constant would keep running its stale machine code. The kernels of this package are checked against a digest of
    all its files and the modules they import from (:func:`package_stamp`) instead (numba's cache locators,
    subclassed: their location is unchanged). Should numba's internals move, caching stays as numba does it."""
    try:
        from numba.core import caching
    except ImportError:  # pragma: no cover
        return
    bases = [getattr(caching, n, None) for n in ("InTreeCacheLocator", "UserWideCacheLocator")]
    if not all(bases) or not hasattr(caching.CacheImpl, "_locator_classes"):  # pragma: no cover
        return
    ours = []
    for base in bases:
        class Locator(base):
            def get_source_stamp(self):
                return stamp

            @classmethod
            def from_function(cls, py_func, py_file):
                if Path(py_file).resolve().parent != _PACKAGE:
                    return None
                return super().from_function(py_func, py_file)

        Locator.__name__ = f"FastEngine{base.__name__}"
        ours.append(Locator)
    caching.CacheImpl._locator_classes[:0] = ours


def _unreadable_index_is_a_miss(stamp: str) -> None:
    """numba unpickles a cache index (every compiled signature of one function, the state classes in them) before it
    compares the index's stamp with the source's: an index written by another version of this package, which named
    a state class that is gone now, raised ``AttributeError`` out of the first call of the kernel instead of
    recompiling it (numba issue 6018; index files are named by function and line, so a kernel moved to a line where
    another version's kernel of the same name was meets that one's index). For this package's kernels (the stamp
    is :func:`package_stamp`'s) an index that cannot be unpickled is a miss, as a stale one is: the kernel compiles
    and numba writes the index anew. Should numba's internals move, caching stays as numba does it."""
    try:
        import pickle

        from numba.core import caching
    except ImportError:  # pragma: no cover
        return
    original = getattr(getattr(caching, "IndexDataCacheFile", None), "_load_index", None)
    if original is None or getattr(original, "_miss_when_unreadable", False):  # pragma: no cover
        return

    def _load_index(self):
        try:
            return original(self)
        except (AttributeError, ImportError, EOFError, pickle.UnpicklingError):
            if getattr(self, "_source_stamp", None) != stamp:
                raise
            return {}

    _load_index._miss_when_unreadable = True
    caching.IndexDataCacheFile._load_index = _load_index


def _copy_callee_ir_once() -> None:
    """numba's inliner (``InlineWorker.inline_ir``, numba 0.59-0.68 at least) deep-copies a callee's IR block by
    block, each block with a copy of the function's whole scope (every variable): blocks x variables per copy, two
    copies per call site. Inlined into one kernel, SAECache's hooks made that 70 % of a 75-second compile (numba
    issues 8989, 9204). Here the copies of one ``inline_ir`` call share one memo, so the IR is copied as the one
    object graph it is: the same IR, in time linear in its size. Only the copy module seen by numba's inliner
    changes, and only during ``inline_ir``; should numba's internals move, inlining stays as numba does it."""
    try:
        import copy as _copy

        from numba.core import inline_closurecall as icc
    except ImportError:  # pragma: no cover
        return
    original = getattr(getattr(icc, "InlineWorker", None), "inline_ir", None)
    if original is None or getattr(icc, "copy", None) is not _copy or getattr(original, "_shared_memo", False):
        return  # pragma: no cover - another numba, or patched already

    class SharedMemo:
        def __init__(self):
            self.memo: dict = {}

        def deepcopy(self, x, memo=None):
            return _copy.deepcopy(x, self.memo if memo is None else memo)

        def __getattr__(self, name):
            return getattr(_copy, name)

    def inline_ir(self, *args, **kwargs):
        icc.copy = SharedMemo()
        try:
            return original(self, *args, **kwargs)
        finally:
            icc.copy = _copy

    inline_ir._shared_memo = True
    icc.InlineWorker.inline_ir = inline_ir


if AVAILABLE:
    _STAMP = cache_stamp()
    _stamp_the_whole_package(_STAMP)
    _unreadable_index_is_a_miss(_STAMP)
    _copy_callee_ir_once()
    from sae_env.fast_engine.cache_load import load_without_linking_ir

    load_without_linking_ir()


# The no-op of each hook (evict has none: a policy must choose its victims).
def _on_request(ps, c, j, now):
    pass


def _on_complete(ps, c, j, now):
    pass


def _on_acquire(ps, c, path, i0, i1):
    pass


def _on_hit(ps, c, path, i0, i1, now):
    pass


def _on_insert(ps, c, s, now):
    pass


def _on_release(ps, c, path, i0, i1, now):
    pass


def _on_leaf(ps, c, s):
    pass


HOOKS = ("on_request", "on_complete", "on_acquire", "on_hit", "on_insert", "on_release", "on_leaf", "evict")
_NOOPS: dict[str, Callable] = {f.__name__[1:]: f for f in (_on_request, _on_complete, _on_acquire, _on_hit,
                                                            _on_insert, _on_release, _on_leaf)}
_IMPLS: dict[type, dict[str, Callable]] = {}
_TEMPLATES: dict[str, Callable] = {}
_KERNELS: dict[tuple[str, type], Callable] = {}


def template(f: Callable) -> Callable:
    """Mark a function of the request loop as a template: it calls hooks (directly or through other templates),
    so it is compiled once per state class, with that class's hooks, by :func:`kernel`. Templates call each other
    and the hooks by their module-level names."""
    _TEMPLATES[f.__name__] = f
    return f


def kernel(entry: str, state_class: type, **constants: Any) -> Callable:
    """The compiled ``entry`` template for policies whose state is a ``state_class``: every template and hook it
    reaches inlined (numba's own inlining of whole functions, before typing), so that each policy gets its own
    machine code with its hooks in place (no call through a pointer, no branch on a policy code). ``constants``
    replace module-level constants of the templates (numba prunes the branches they decide before inlining).
    Cached on disk like any kernel: one cache entry per state class and constants."""
    key = (entry, state_class, *sorted(constants.items()))
    k = _KERNELS.get(key)
    if k is None:
        impls = _IMPLS.get(state_class, {})
        if "evict" not in impls:
            raise TypeError(f"compiled policy state {state_class.__name__} has no evict hook")
        first = _TEMPLATES[entry]
        scope = {**first.__globals__, **constants}
        for name in HOOKS:
            scope[name] = inline(impls.get(name) or _NOOPS[name])
        for name, f in _TEMPLATES.items():
            copy = types.FunctionType(f.__code__, scope, name, f.__defaults__)
            scope[name] = copy if name == entry else inline(copy)
        # numba's disk cache tells kernels apart by their qualified name and signature: kernels that differ only in
        # their constants need names of their own.
        scope[entry].__qualname__ = "__".join([entry, *(f"{k}_{v}" for k, v in sorted(constants.items()))])
        name = f"{state_class.__qualname__}.{scope[entry].__qualname__}"
        k = _KERNELS[key] = _compiled_once(key, jit(scope[entry]), name)
    return k


def _compiled_once(key: tuple, k: Callable, name: str) -> Callable:
    """``k`` whose first call in this process (where numba compiles it, or loads it from the disk cache) holds a
    lock file of its own, so that processes that start at once compile a kernel once: the test suite's workers and
    its warm-up process, Ray's workers on a fresh install. Without it each compiled it (SAECache's take about a
    minute each), and the others' compiles only made the machine slower. The second process waits, then loads what
    the first wrote to the cache. Later calls go to ``k`` itself. No lock where the platform has no ``fcntl``."""
    try:
        import fcntl
        import tempfile
    except ImportError:  # pragma: no cover - not POSIX
        return k
    path = kernel_lock(name, Path(tempfile.gettempdir()))

    def first_call(*args: Any) -> Any:
        try:
            path.parent.mkdir(exist_ok=True)
            fd = open(path, "a")  # noqa: SIM115 - held for the compile, closed below
        except OSError:  # an unwritable temporary folder: compile as if alone
            fd = None
        try:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            out = k(*args)
        finally:
            if fd is not None:
                fd.close()  # (closing releases the lock; so does the process's end, however it ends)
        _KERNELS[key] = k
        return out

    first_call.dispatcher = k
    return first_call


def kernel_lock(name: str, folder: Path) -> Path:
    """The lock file of kernel ``name`` (state class and entry, as :func:`kernel` names it) under ``folder`` (the
    temporary folder), per version of the package: another version's kernel of the same name is another kernel."""
    digest = hashlib.sha256(f"{globals().get('_STAMP')};{name}".encode()).hexdigest()[:24]
    return folder / "saecache-gym-kernels" / f"{digest}.lock"


def rebind(f: Callable, **names: Any) -> Callable:
    """A copy of plain function ``f`` that sees ``names`` instead of its module's globals of those names (a hook
    written once for a family of policies, specialised per policy: numba compiles the copy, not a closure)."""
    scope = {**f.__globals__, **names}
    return types.FunctionType(f.__code__, scope, f.__name__, f.__defaults__)


def implements(state_class: type, hook: str) -> Callable[[Callable], Callable]:
    """Register the decorated (plain Python) function as ``hook`` of the compiled policy whose state is a
    ``state_class``; it is compiled inlined into that policy's kernels."""
    if hook not in HOOKS:
        raise ValueError(f"unknown hook {hook!r}; hooks: {list(HOOKS)}")

    def deco(f: Callable) -> Callable:
        _IMPLS.setdefault(state_class, {})[hook] = f
        return f

    return deco


# The hooks' default names, which the templates call; kernel() binds them to a policy's implementations.
on_request, on_complete, on_acquire, on_hit, on_insert, on_release, on_leaf = (inline(f) for f in _NOOPS.values())


@inline
def evict(ps, c, now):  # pragma: no cover - replaced in every kernel
    return -1
