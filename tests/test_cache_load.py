"""Loading cached kernels without parsing their linking IR (sae_env.fast_engine.cache_load)."""

from __future__ import annotations

import functools
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

numba = pytest.importorskip("numba")

from sae_env.fast_engine import cache_load, treap  # noqa: E402


def _bitcode_defined(bitcode: bytes) -> set[str]:
    """What numba's own load registers: the defined functions and globals of the linking module."""
    from llvmlite import binding as ll

    m = ll.parse_bitcode(bitcode)
    return {g.name for gs in (m.functions, m.global_variables) for g in gs if not g.is_declaration}


def _cached_libraries() -> list[tuple[str, bytes, bytes]]:
    """(file, object code, linking bitcode) of every kernel in the package's disk cache (numba's .nbc files)."""
    from pathlib import Path

    out = []
    for f in sorted(Path(treap.lower._cache._cache_path).glob("*.nbc")):
        library = pickle.loads(f.read_bytes())[0]  # (name, kind, data): CPUCodeLibrary.serialize_using_object_code
        if library[1] == "object":
            out.append((f.name, *library[2]))
    return out


def test_the_patch_is_in_place():
    from numba.core.codegen import CPUCodeLibrary

    assert cache_load.load_without_linking_ir()  # idempotent: already applied when the package imported numba
    assert getattr(CPUCodeLibrary._get_module_for_linking, "_lazy", False)


def test_object_symbols_are_the_bitcodes_defined_names():
    """On the package's cached kernels, SAECache's and LRU's request loops among them: the names numba would
    register at load."""
    from sae_env.cache import PrefixCache
    from sae_env.policies import make_policy
    from sae_env.replay import Replay
    from sae_env.sources import open_trace

    trace, _ = open_trace("bailian")
    for name in ("lru", "saecache"):  # their kernels cached (compiled here if no test compiled them yet)
        r = Replay(trace, PrefixCache(100, make_policy(name)), engine="fast")
        r.run()
        assert r.engine == "fast"
    libraries = _cached_libraries()
    assert sum("run_window" in name for name, _, _ in libraries) >= 2
    for name, obj, bitcode in libraries:
        assert cache_load.elf_defined_symbols(obj) == _bitcode_defined(bitcode), name


def test_not_an_elf_object_is_none():
    assert cache_load.elf_defined_symbols(b"") is None
    assert cache_load.elf_defined_symbols(b"\xcf\xfa\xed\xfe" + bytes(100)) is None  # Mach-O
    assert cache_load.elf_defined_symbols(b"\x7fELF\x01\x01" + bytes(100)) is None  # 32-bit
    assert cache_load.elf_defined_symbols(b"\x7fELF\x02\x01" + bytes(58) + b"\xff\xff\x40\x00" + bytes(40)) is None


@functools.cache
def _an_object() -> bytes:
    """One real kernel's object code (treap.lower's, in numba's disk cache once it has been called)."""
    treap.lower(np.array([-1], dtype=np.int64), np.zeros((2, 8), dtype=np.int32), np.int64(0))
    return next(obj for name, obj, _ in _cached_libraries() if name.startswith("treap.lower"))


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_damaged_objects_give_none_or_names_never_an_error(data):
    """Fuzz: a real kernel's object cut short or with bytes overwritten is read as None (numba then loads it its
    own way) or as a set of names; nothing raises out of the loader."""
    obj = bytearray(_an_object())
    if data.draw(st.booleans()):
        del obj[data.draw(st.integers(0, len(obj))):]
    for _ in range(data.draw(st.integers(0, 8))):
        if obj:
            obj[data.draw(st.integers(0, len(obj) - 1))] = data.draw(st.integers(0, 255))
    names = cache_load.elf_defined_symbols(bytes(obj))
    assert names is None or (isinstance(names, set) and all(isinstance(n, str) for n in names))


def test_an_object_without_a_symbol_table_is_none():
    """Its names unknown, numba's own load decides (a set, even empty, would register what it says)."""
    import struct

    obj = bytearray(_an_object())
    assert cache_load.elf_defined_symbols(bytes(obj))
    shoff, = struct.unpack_from("<Q", obj, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", obj, 0x3A)
    for i in range(shnum):
        if struct.unpack_from("<I", obj, shoff + i * shentsize + 4)[0] == 2:  # SHT_SYMTAB -> SHT_NOTE
            struct.pack_into("<I", obj, shoff + i * shentsize + 4, 7)
    assert cache_load.elf_defined_symbols(bytes(obj)) is None


def test_a_function_compiled_later_links_a_lazily_loaded_kernel():
    """In a fresh process treap.lower loads from the disk cache without its bitcode parsed; a new function that
    calls it links (and so parses) it then, and computes what treap.lower does."""
    code = textwrap.dedent("""
        import numpy as np, numba
        from sae_env.fast_engine import treap
        from sae_env.fast_engine.loop import P0
        root = np.array([-1], dtype=np.int64)
        rec = np.zeros((8, max(treap.UP, P0) + 1), dtype=np.int32)
        for s in range(5):
            rec[s, treap.GROUP], rec[s, treap.WHERE], rec[s, treap.STAMP] = 1, 1, 10 * s
            treap.insert(root, rec, np.int64(s))
        k = (np.int64(1) << 33) + 15
        direct = treap.lower(root, rec, k)
        library = next(iter(treap.lower.overloads.values())).library
        lazy_before = hasattr(library, "_linking_bitcode")

        @numba.njit
        def through(root, rec, k):
            return treap.lower(root, rec, k) + 100

        linked = through(root, rec, k)
        print(direct, lazy_before, hasattr(library, "_linking_bitcode"), linked)
    """)
    _an_object()  # cached here, so the subprocess loads it and does not compile it
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["2", "True", "False", "102"]  # slot 2 (stamp 20) is the least key >= stamp 15
