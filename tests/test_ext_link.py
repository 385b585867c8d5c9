"""The compiled extension links the shared C++ runtime (libstdc++.so.6), never a private static
copy. A toolchain that links libstdc++ statically (issue 11: LDFLAGS=-static-libstdc++, or a
compiler configured so) puts a second C++ runtime in the process beside torch's; TORCH_CHECK
messages thrown from the extension then come out truncated ('tokens id ') or crash.

The extension's ELF file is read here in pure Python (no readelf needed): its DT_NEEDED entries
(.dynamic, names in .dynstr) and the symbols it defines (.dynsym).
"""

import collections
import os
import shutil
import struct
import subprocess
import sys

import pytest
import torch

import bert_fast
from bert_fast import extension

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF shared libraries: Linux only")

SHT_DYNSYM, SHT_DYNAMIC = 11, 6
DT_NULL, DT_NEEDED = 0, 1
SHN_UNDEF = 0
SECTION_HEADER = struct.Struct("<IIQQQQIIQQ")  # Elf64_Shdr
Section = collections.namedtuple("Section", "name type flags addr offset size link info addralign entsize")
DYNAMIC_ENTRY = struct.Struct("<qQ")           # Elf64_Dyn: tag, value
SYMBOL = struct.Struct("<IBBHQQ")              # Elf64_Sym: name info other shndx value size


class Elf64:
    """The dynamic-linking facts of a little-endian ELF64 shared library, from its section headers."""

    def __init__(self, path):
        with open(path, "rb") as f:
            self.data = f.read()
        if self.data[:4] != b"\x7fELF" or self.data[4] != 2 or self.data[5] != 1:
            raise ValueError(f"{path} is not a little-endian ELF64 file")
        table_offset, = struct.unpack_from("<Q", self.data, 0x28)            # e_shoff
        entry_size, count = struct.unpack_from("<HH", self.data, 0x3A)        # e_shentsize, e_shnum
        if table_offset == 0 or count == 0:
            raise ValueError(f"{path} has no section headers to read")
        self.sections = [Section(*SECTION_HEADER.unpack_from(self.data, table_offset + i * entry_size))
                         for i in range(count)]

    def _sections_of_type(self, section_type):
        return [s for s in self.sections if s.type == section_type]

    def _string(self, strtab_index, offset):
        start = self.sections[strtab_index].offset + offset
        return self.data[start:self.data.index(b"\0", start)].decode()

    def needed(self):
        """The DT_NEEDED entries: the libraries the dynamic loader loads with this one."""
        names = []
        for dynamic in self._sections_of_type(SHT_DYNAMIC):     # strings in the section it links to
            for at in range(dynamic.offset, dynamic.offset + dynamic.size, DYNAMIC_ENTRY.size):
                tag, value = DYNAMIC_ENTRY.unpack_from(self.data, at)
                if tag == DT_NULL:
                    break
                if tag == DT_NEEDED:
                    names.append(self._string(dynamic.link, value))
        return names

    def dynamic_symbols(self):
        """{name: defined here?} for the dynamic symbol table (undefined ones are imports)."""
        symbols = {}
        for dynsym in self._sections_of_type(SHT_DYNSYM):
            for at in range(dynsym.offset + SYMBOL.size, dynsym.offset + dynsym.size, SYMBOL.size):  # 0: null
                name, _, _, section_index, _, _ = SYMBOL.unpack_from(self.data, at)
                symbols[self._string(dynsym.link, name)] = section_index != SHN_UNDEF
        return symbols

    def defines(self, symbol):
        return self.dynamic_symbols().get(symbol, False)


def mapped_libraries():
    """The paths of the shared libraries mapped into this process."""
    paths = set()
    with open("/proc/self/maps") as f:
        for line in f:     # address perms offset device inode [path]
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith("/") and ".so" in fields[5]:
                paths.add(fields[5].rstrip("\n"))
    return paths


def is_bert_fast_extension(path):
    name = os.path.basename(path)
    built_by_setup = name.startswith("_C.") and os.path.basename(os.path.dirname(path)) == "bert_fast"
    return built_by_setup or name.startswith(extension.JIT_NAME)


@pytest.fixture(scope="module")
def loaded_extension():
    """The ELF file of the extension this process loaded (setup.py's bert_fast._C or the JIT build)."""
    bert_fast.build_extension(verbose=False)
    paths = sorted(p for p in mapped_libraries() if is_bert_fast_extension(p))
    assert len(paths) == 1, f"expected one loaded bert_fast extension, found {paths}"
    return paths[0]


@pytest.fixture(scope="module")
def libc10():
    return os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")


def test_reader_on_torch_libc10(libc10):
    elf = Elf64(libc10)
    assert "libstdc++.so.6" in elf.needed() and "libc.so.6" in elf.needed()
    symbols = elf.dynamic_symbols()
    assert symbols["__cxa_throw"] is False          # imported: c10 throws through the shared runtime
    assert any(defined and name.startswith("_ZN3c10") for name, defined in symbols.items())


def test_reader_on_the_shared_libstdcxx():
    runtime = [p for p in mapped_libraries() if os.path.basename(p).startswith("libstdc++.so.6")]
    assert runtime, "torch loads libstdc++.so.6, so it is mapped in this process"
    assert Elf64(runtime[0]).defines("__cxa_throw")


@pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf is not installed")
def test_reader_agrees_with_readelf(libc10):
    listing = subprocess.run(["readelf", "-d", libc10], capture_output=True, text=True, check=True).stdout
    from_readelf = [line.split("[", 1)[1].rstrip("]") for line in listing.splitlines() if "(NEEDED)" in line]
    assert Elf64(libc10).needed() == from_readelf


@pytest.mark.skipif("BERT_FAST_EXPECTED_EXTENSION" not in os.environ,
                    reason="BERT_FAST_EXPECTED_EXTENSION (set by scripts/ci_hostile_toolchain.sh) is not set")
def test_loaded_extension_is_the_expected_build(loaded_extension):
    """The CI script builds in a scratch copy: the tests must run against that build."""
    assert os.path.samefile(loaded_extension, os.environ["BERT_FAST_EXPECTED_EXTENSION"])


def test_extension_needs_the_shared_libstdcxx(loaded_extension):
    needed = Elf64(loaded_extension).needed()
    assert "libstdc++.so.6" in needed, (
        f"{loaded_extension} does not load the shared C++ runtime (DT_NEEDED: {needed}): libstdc++ was "
        "linked statically (-static-libstdc++?), a second C++ runtime beside torch's (issue 11)")


def test_extension_has_no_private_cxx_runtime(loaded_extension):
    assert not Elf64(loaded_extension).defines("__cxa_throw"), (
        f"{loaded_extension} defines __cxa_throw itself: it carries a static copy of libstdc++, "
        "a second C++ runtime beside torch's (issue 11)")
