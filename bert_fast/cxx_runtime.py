"""The linker flags that give the compiled extension the C++ runtime torch already uses.

The extension must share torch's libstdc++: a private copy linked statically into it puts two
C++ runtimes in one process, and the TORCH_CHECK errors thrown from its ops then come out
truncated or kill the process (issue 11). ``-Wl,-Bdynamic -lstdc++`` was not enough: on the
H100 machine of 2026-11-26 (g++ 13.3 under /opt/gcc) ``ldd`` listed no libstdc++ for the
extension built with it, and every input check whose message formats a number ended in a
segfault, on the CPU and CUDA ops alike. So the extension links the very file this process has
loaded (torch's), by path; ``-lstdc++`` only where no libstdc++ is loaded. CI builds it the
way such toolchains do (scripts/ci_hostile_toolchain.sh); tests/test_ext_link.py reads the result.

No imports beyond the standard library: setup.py loads this file on its own, before bert_fast
is installed. Call it after ``import torch``.
"""

import sys


def loaded_libstdcxx():
    """The path of the libstdc++ mapped into this process (Linux), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "/libstdc++.so" in line})
    except OSError:
        return None
    return paths[0] if paths else None


def shared_cxx_runtime_flags():
    """Linker arguments for the extension: the loaded libstdc++ by path (Linux), else -lstdc++."""
    if not sys.platform.startswith("linux"):
        return []
    loaded = loaded_libstdcxx()
    return [loaded] if loaded else ["-Wl,-Bdynamic", "-lstdc++"]
