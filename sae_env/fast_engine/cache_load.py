"""Loading a cached kernel without parsing its linking IR.

numba caches a compiled function as its object code plus the LLVM bitcode of its whole module, kept so that a
function compiled later can link (and inline) it. Loading it from the disk cache (``CPUCodeLibrary._unserialize``;
numba 0.68 here) parses that bitcode at once, and walks every function and global of it to learn the names the
object defines: for SAECache's request loop 182 KB of bitcode, 6-7 ms to parse, and a few ms more for the walk,
whose every step is an llvmlite call that numba wraps in its lock and event hooks. That was about two thirds of
SAECache's first replay of the shipped Bailian trace (22 requests: 16.4 -> 5.3 ms without it) and a third on
mooncake_synthetic's 3,993 (27 -> 17 ms).

:func:`load_without_linking_ir` changes only that load. The names come from the object's own ELF symbol table (the
same set: every symbol the object defines, bar the file and section symbols, which is the set of the bitcode's
defined functions and globals; ``tests/test_cache_load.py`` compares them on the package's kernels), and the
bitcode is parsed the first time another library links this one. Anything that is not an ELF64 little-endian object
(macOS, Windows) loads as numba loads it; should numba's internals move, loading stays as numba does it.
"""

from __future__ import annotations

import struct

__all__ = ["elf_defined_symbols", "load_without_linking_ir"]

_SHT_SYMTAB = 2
_STT_SECTION, _STT_FILE = 3, 4
_SHN_UNDEF = 0


def elf_defined_symbols(obj: bytes) -> set[str] | None:
    """The names of the symbols that ELF64 little-endian object ``obj`` defines (any binding, not the file and
    section symbols); None if ``obj`` is not such an object, or not a well-formed one (numba then loads it)."""
    if len(obj) < 64 or obj[:4] != b"\x7fELF" or obj[4] != 2 or obj[5] != 1:
        return None
    try:
        return _symbols(obj)
    except (struct.error, ValueError, IndexError):  # ValueError: a name without its NUL, or not UTF-8
        return None


def _symbols(obj: bytes) -> set[str] | None:
    shoff, = struct.unpack_from("<Q", obj, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", obj, 0x3A)
    if shentsize < 64 or shoff + shnum * shentsize > len(obj):
        return None
    sections = [struct.unpack_from("<IIQQQQIIQQ", obj, shoff + i * shentsize) for i in range(shnum)]
    names: set[str] = set()
    tables = 0
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind != _SHT_SYMTAB:
            continue
        tables += 1
        if entsize != 24 or link >= shnum or offset + size > len(obj):
            return None
        strtab = sections[link][4]
        for st_name, st_info, _, st_shndx, _, _ in struct.iter_unpack("<IBBHQQ", obj[offset:offset + size]):
            if st_shndx == _SHN_UNDEF or st_name == 0 or (st_info & 15) in (_STT_SECTION, _STT_FILE):
                continue
            start = strtab + st_name
            names.add(obj[start:obj.index(b"\0", start)].decode())
    return names if tables else None  # numba's objects have one: without it, numba's own load decides


def load_without_linking_ir() -> bool:
    """Patch numba's loading of cached object code as the module docstring says; True if it is in place."""
    try:
        from llvmlite import binding as ll
        from numba.core.codegen import CPUCodeLibrary
    except ImportError:  # pragma: no cover - without numba nothing is cached
        return False
    unserialize = CPUCodeLibrary.__dict__.get("_unserialize")
    for_linking = getattr(CPUCodeLibrary, "_get_module_for_linking", None)
    if getattr(for_linking, "_lazy", False):
        return True
    # What this replaces, by the names its code uses: another numba's load may do more, and then keeps its own.
    expected = {"create_library", "enable_object_caching", "_set_compiled_object", "parse_bitcode",
                "_shared_module", "_finalize_final_module", "_load_defined_symbols"}
    if not isinstance(unserialize, classmethod) or for_linking is None \
            or not expected <= set(unserialize.__func__.__code__.co_names):
        return False  # pragma: no cover - another numba
    original = unserialize.__func__

    def _unserialize(cls, codegen, state):
        name, kind, data = state
        engine = getattr(codegen, "_engine", None)
        defined = getattr(engine, "_defined_symbols", None)
        if kind == "object" and isinstance(defined, set):
            object_code, linking_bitcode = data
            names = elf_defined_symbols(object_code)
            if names is not None:
                self = codegen.create_library(name)
                self.enable_object_caching()
                self._set_compiled_object(object_code)
                self._linking_bitcode = linking_bitcode  # parsed by _get_module_for_linking, if ever
                self._finalize_final_module()
                defined |= names
                return self
        return original(cls, codegen, state)

    def _get_module_for_linking(self):
        bitcode = self.__dict__.pop("_linking_bitcode", None)
        if bitcode is not None:
            self._shared_module = ll.parse_bitcode(bitcode)
        return for_linking(self)

    _get_module_for_linking._lazy = True
    CPUCodeLibrary._unserialize = classmethod(_unserialize)
    CPUCodeLibrary._get_module_for_linking = _get_module_for_linking
    return True
