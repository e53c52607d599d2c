"""The one source list and flag set shared by ``setup.py`` and the JIT loader (``load_extension``)."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path
from typing import Dict, List, Optional

# setup.py loads this file by path, before the package is importable: load the switch table the same way.
_env_spec = importlib.util.spec_from_file_location("_rc_env", Path(__file__).with_name("_env.py"))
_env = importlib.util.module_from_spec(_env_spec)
_env_spec.loader.exec_module(_env)

_PACKAGE_DIR = Path(__file__).resolve().parent
# A source checkout (or editable install) has csrc/ beside the package; a wheel carries a copy inside the package
# (setup.py's build_py puts it there), so load_extension() works from either.
ROOT = _PACKAGE_DIR.parent if (_PACKAGE_DIR.parent / "csrc" / "ops.cpp").is_file() else _PACKAGE_DIR
CSRC = ROOT / "csrc"

#: Sources of the always-built CPU part (schemas + CPU kernels).
CPU_SOURCES: List[str] = [
    "csrc/ops.cpp",
    "csrc/cpu/logprob.cpp",
    "csrc/cpu/rollout_correction.cpp",
    "csrc/cpu/policy_loss.cpp",
    "csrc/cpu/sampling.cpp",
    "csrc/cpu/linear.cpp",
]

#: CUDA launchers (device code lives in csrc/cuda/*_kernels.cuh, included by these).
CUDA_SOURCES: List[str] = [
    "csrc/cuda/logprob.cu",
    "csrc/cuda/rollout_correction.cu",
    "csrc/cuda/policy_loss.cu",
    "csrc/cuda/sampling.cu",
]

INCLUDE_DIRS: List[str] = ["csrc/include", "csrc"]

CXX_FLAGS: List[str] = ["-O3", "-fopenmp", "-Wall", "-Wno-unknown-pragmas", "-Wno-psabi"]
NVCC_FLAGS: List[str] = [
    "-O3",
    "-lineinfo",
    "--expt-relaxed-constexpr",
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
]
DEFAULT_CUDA_ARCHS = "8.0;9.0+PTX"


def abs_paths(paths: List[str]) -> List[str]:
    return [str(ROOT / p) for p in paths]


def skip_build() -> bool:
    """``ROLLOUT_CORR_SKIP_BUILD=1``: setup.py installs the Python package without compiling the extension."""
    return _env.flag("ROLLOUT_CORR_SKIP_BUILD")


def want_cuda() -> bool:
    """CUDA kernels are built when torch is a CUDA build, nvcc exists, and a GPU is visible or FORCE_CUDA=1."""
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    if torch.version.cuda is None or CUDA_HOME is None:
        return False
    if not (Path(CUDA_HOME) / "bin" / "nvcc").exists():
        return False
    return _env.flag("FORCE_CUDA") or torch.cuda.is_available()


def cuda_include_dirs() -> List[str]:
    """torch's CUDA headers include cusparse.h/cublas*.h, shipped in the nvidia wheels (nvidia/cu13/include)."""
    dirs = []
    try:
        import nvidia  # the namespace package of the nvidia-* wheels

        for base in nvidia.__path__:
            for sub in sorted(Path(base).glob("*/include")):
                if sub.is_dir():
                    dirs.append(str(sub))
    except ImportError:
        pass
    return dirs


def extension_kwargs(with_cuda: bool) -> Dict[str, object]:
    sources = CPU_SOURCES + (CUDA_SOURCES if with_cuda else [])
    cxx = list(CXX_FLAGS) + (["-DRC_WITH_CUDA"] if with_cuda else [])
    kwargs: Dict[str, object] = {
        "sources": sources,
        "include_dirs": abs_paths(INCLUDE_DIRS) + (cuda_include_dirs() if with_cuda else []),
        "extra_compile_args": {"cxx": cxx},
        "extra_link_args": ["-fopenmp"],
    }
    if with_cuda:
        kwargs["extra_compile_args"]["nvcc"] = list(NVCC_FLAGS) + ["-DRC_WITH_CUDA"]  # type: ignore[index]
    return kwargs


#: What a build compiles from csrc/ (the sdist's MANIFEST.in takes the same; bootstrap.sh's stamp calls source_hash).
SOURCE_SUFFIXES = (".h", ".cpp", ".cu", ".cuh", ".def")
#: Beside each module setup.py builds, ``<module file>.sources`` holds :func:`source_hash` of what it compiled.
SOURCES_SUFFIX = ".sources"


def source_hash(csrc: Optional[Path] = None) -> Optional[str]:
    """A hash of every source under ``csrc`` (names and contents; default: this package's csrc/), None without one.
    setup.py writes it beside the module it builds; the package compares it at import (``__init__``), so that a
    module built from other sources (a checkout updated without a rebuild) is refused rather than run with op
    schemas and slot layouts other than the ones the Python side reads from csrc/."""
    csrc = CSRC if csrc is None else Path(csrc)
    if not csrc.is_dir():
        return None
    h = hashlib.sha256()
    for path in sorted(p for p in csrc.rglob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file()):
        h.update(path.relative_to(csrc).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


if __name__ == "__main__":  # scripts/bootstrap.sh's build stamp: the build record's own hash, one list of suffixes
    print(source_hash())
