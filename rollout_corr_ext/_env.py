"""Every environment switch this package reads, in one table, read in one place (docs/configuration.md lists them).

The C++ side reads its two (``ROLLOUT_CORR_CPU_ISA``, ``ROLLOUT_CORR_CPU_CACHE``) in ``csrc/cpu/switches.h``; they are
listed here too so the table is complete. ``tests/test_switches.py`` holds the table, the docs table and the sources
(every ``ROLLOUT_CORR_*`` name they mention) to each other.
"""

from __future__ import annotations

import os
from typing import NamedTuple, Optional


class Switch(NamedTuple):
    name: str
    default: str
    read_by: str  # "python" (this module), "c++" (csrc/cpu/switches.h), "build" (setup.py / the JIT loader) or
    #               "tests" (the test support, rollout_corr_testing/, through this module; the emulator's header)
    meaning: str


SWITCHES = (
    Switch("ROLLOUT_CORR_FORCE_FALLBACK", "0", "python",
           "1: never load the compiled extension; every op runs the pure-PyTorch fallback (tests run on it too)"),
    Switch("ROLLOUT_CORR_FORCE_REFERENCE", "0", "python",
           "the former name of ROLLOUT_CORR_FORCE_FALLBACK, still read (with a DeprecationWarning) when that is unset"),
    Switch("ROLLOUT_CORR_JIT", "0", "python",
           "1: when no prebuilt extension is importable, JIT-compile it at import (load_extension())"),
    Switch("ROLLOUT_CORR_BUILD_DIR", "", "python",
           "where load_extension() (and the test suite's JIT build) keeps its build; empty: torch's default"),
    Switch("ROLLOUT_CORR_CPU_ISA", "", "c++",
           "avx512 | avx2 | baseline: narrow the CPU kernels' SIMD copy (every CPU kernel); empty: the widest the "
           "CPU runs; read once per process"),
    Switch("ROLLOUT_CORR_CPU_CACHE", "1", "c++",
           "0: the CPU kernels keep no reused output block between calls (empty_cpu_cache() frees them any time)"),
    Switch("FORCE_CUDA", "0", "build",
           "1: build the CUDA kernels without a visible GPU (setup.py, load_extension()); needs nvcc under CUDA_HOME"),
    Switch("TORCH_CUDA_ARCH_LIST", "8.0;9.0", "build", "the GPU architectures the CUDA kernels are built for"),
    Switch("MAX_JOBS", "", "build", "parallel compile jobs (torch.utils.cpp_extension)"),
    Switch("ROLLOUT_CORR_SKIP_BUILD", "0", "build",
           "1: setup.py installs the Python package without compiling the extension (scripts/bootstrap.sh then "
           "builds it in place with `setup.py build_ext --inplace`; or load_extension() / ROLLOUT_CORR_JIT=1)"),
    Switch("ROLLOUT_CORR_EMU_BUILD_DIR", "", "tests",
           "where the CUDA emulator (rollout_corr_testing/cuda_emulator) keeps its g++ build; CI sets build/emu"),
    Switch("ROLLOUT_CORR_EMU_ASAN", "0", "tests", "1: build the CUDA emulator under AddressSanitizer (run_asan.sh)"),
    Switch("ROLLOUT_CORR_EMU_RACECHECK", "0", "tests",
           "1: the emulator checks shared-memory races in every launch (its header reads it; tests set it)"),
)

_BY_NAME = {s.name: s for s in SWITCHES}
#: new name -> former name (read when the new one is unset)
_RENAMED = {"ROLLOUT_CORR_FORCE_FALLBACK": "ROLLOUT_CORR_FORCE_REFERENCE"}


def get(name: str) -> str:
    """The switch's value, or its default when unset (a name not in :data:`SWITCHES` is a programming error)."""
    spec = _BY_NAME[name]
    old = _RENAMED.get(name)
    if old is not None and name not in os.environ and old in os.environ:
        import warnings

        warnings.warn(f"{old} is renamed {name}; set that instead", DeprecationWarning, stacklevel=3)
        return os.environ[old]
    return os.environ.get(name, spec.default)


def flag(name: str) -> bool:
    """A 0/1 switch."""
    return get(name) == "1"


def path(name: str) -> Optional[str]:
    return get(name) or None
