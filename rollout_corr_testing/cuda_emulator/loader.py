"""Builds the emulated kernel families (csrc/cuda/*_kernels.cuh compiled by g++ against cuda_emu.h).

``load_emulator()`` JIT-compiles ``emu_*.cpp`` into one CPU extension registering ``torch.ops.rollout_corr_emu.*``.
``kernel_override_dir`` puts a folder before ``csrc/cuda`` on the include path, which is how the self-test
compiles deliberately broken copies of a kernel file. ``sanitize=True`` builds with AddressSanitizer (the
process must then run with libasan preloaded; see docs/cuda_kernels.md).

The regular build carries the emulator's instruments (cuda_emu.h): line tables (-g1, so racecheck names source
lines) and GCC's kernel-address-sanitizer instrumentation in its outline form, whose per-access callbacks cuda_emu.h
defines (racecheck sees every load and store of the emulated code). The AddressSanitizer build cannot have both:
there racecheck is unavailable (``torch.ops.rollout_corr_emu.racecheck_available()`` is False).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Optional

from rollout_corr_ext import _env

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
EMU_SOURCES = sorted(str(p) for p in HERE.glob("emu_*.cpp"))
#: Always built: the instruments' ops (record_start, launch_records, set_racecheck, ...).
STATS_SOURCE = str(HERE / "emu_stats.cpp")
#: The racecheck instrumentation: a call to __asan_{load,store}N_noabort before every access, nothing else.
RACECHECK_FLAGS = ["-fsanitize=kernel-address", "--param=asan-instrumentation-with-call-threshold=0",
                   "--param=asan-stack=0", "--param=asan-globals=0", "-DRC_EMU_RACECHECK=1"]

_loaded = False


def _include_dirs(kernel_override_dir: Optional[str]):
    dirs = [str(HERE)]
    if kernel_override_dir:
        dirs.append(str(kernel_override_dir))
    dirs += [str(ROOT / "csrc" / "cuda"), str(ROOT / "csrc" / "include"), str(ROOT / "csrc")]
    return dirs


def load_emulator(kernel_override_dir: Optional[str] = None, sanitize: Optional[bool] = None,
                  verbose: bool = False, sources: Optional[list] = None) -> None:
    """Compile (cached by torch in its extensions folder) and load the emulated kernels into this process.

    ``sources``: file names of the ``emu_*.cpp`` families to build (default: all of them).
    """
    global _loaded
    if _loaded:
        return
    from torch.utils.cpp_extension import load

    if sanitize is None:
        sanitize = _env.flag("ROLLOUT_CORR_EMU_ASAN")
    flags = ["-O1", "-g1", "-fno-omit-frame-pointer", "-Wall", "-Wno-unknown-pragmas", "-Wno-unused-function"]
    if sanitize:
        flags += ["-fsanitize=address", "-fno-sanitize-recover=all"]
    else:
        flags += RACECHECK_FLAGS
    chosen = EMU_SOURCES if sources is None else [str(HERE / name) for name in sources]
    if STATS_SOURCE not in chosen:
        chosen = chosen + [STATS_SOURCE]
    key = hashlib.sha1(repr((kernel_override_dir, sanitize, sorted(chosen))).encode()).hexdigest()[:10]
    build_dir = _env.path("ROLLOUT_CORR_EMU_BUILD_DIR")
    if build_dir:
        build_dir = os.path.join(build_dir, key)
        os.makedirs(build_dir, exist_ok=True)
    load(
        name=f"rollout_corr_emu_{key}",
        sources=chosen,
        extra_include_paths=_include_dirs(kernel_override_dir),
        extra_cflags=flags,
        extra_ldflags=["-fsanitize=address"] if sanitize else [],
        is_python_module=False,
        build_directory=build_dir,
        verbose=verbose,
    )
    _loaded = True
