"""Per-kernel registers / shared memory / stack for one SM architecture, as `cuobjdump --dump-resource-usage`
reports them, as a markdown table (docs/cuda_kernels.md).

    FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST="8.0;9.0" python setup.py build_ext --build-temp build/cuda-gate/temp \
        --build-lib build/cuda-gate/lib
    python scripts/cuda_resource_usage.py build/cuda-gate/lib --arch sm_90
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path


def find_extension(path: Path) -> Path:
    if path.is_file():
        return path
    found = sorted(path.rglob("_C*.so"))
    if not found:
        sys.exit(f"no _C*.so under {path}: build the CUDA extension first (see the docstring)")
    return found[0]


def find_cuobjdump() -> str:
    """CUDA_HOME's cuobjdump, else one on PATH, else the copy that triton's wheel (a torch dependency) ships."""
    candidates = [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump"),
                  shutil.which("cuobjdump") or ""]
    try:
        import triton

        candidates.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))
    except ImportError:
        pass
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    sys.exit("cuobjdump not found (CUDA_HOME/bin, PATH, triton's backends/nvidia/bin)")


def demangle(names):
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    for tool in (os.path.join(cuda_home, "bin", "cu++filt"), "c++filt"):
        try:
            out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True, check=True).stdout
            return out.splitlines()
        except (OSError, subprocess.CalledProcessError):
            continue
    return list(names)


def short_name(demangled: str) -> str:
    """`void rollout_corr::vocab_row_stats_kernel<c10::BFloat16, float, 8>(rollout_corr::RowStatsParams<...>)`
    -> `vocab_row_stats_kernel<c10::BFloat16, float, 8>`."""
    name = demangled.split("(", 1)[0]
    name = re.sub(r"^void\s+", "", name)
    return name.replace("rollout_corr::", "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", type=Path, help="the built extension (.so) or a folder holding it")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--full", action="store_true", help="one row per template instantiation (default: per kernel)")
    args = p.parse_args()
    so = find_extension(args.path)
    cuobjdump = find_cuobjdump()
    text = subprocess.run([cuobjdump, "--dump-resource-usage", str(so)], capture_output=True, text=True,
                          check=True).stdout
    rows, arch = [], None
    for line in text.splitlines():
        m = re.search(r"arch = (sm_\d+)", line)
        if m:
            arch = m.group(1)
        m = re.search(r"Function (\S+):", line)
        if m:
            current = m.group(1)
            continue
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", line)
        if m and arch == args.arch:
            rows.append((current, *map(int, m.groups())))
    names = [short_name(n) for n in demangle([r[0] for r in rows])]
    if args.full:
        print(f"| kernel ({args.arch}) | registers / thread | shared (B / block) | stack (B) | local (B) |")
        print("|---|---|---|---|---|")
        for (mangled, reg, stack, shared, local), name in sorted(zip(rows, names), key=lambda x: x[1]):
            print(f"| `{name}` | {reg} | {shared} | {stack} | {local} |")
        return
    groups = {}
    for (mangled, reg, stack, shared, local), name in zip(rows, names):
        groups.setdefault(name.split("<", 1)[0], []).append((reg, shared, stack, local))

    def span(values):
        lo, hi = min(values), max(values)
        return str(lo) if lo == hi else f"{lo}-{hi}"

    print(f"| kernel ({args.arch}) | instantiations | registers / thread | shared (B / block) | stack (B) | local (B) |")
    print("|---|---|---|---|---|---|")
    for base in sorted(groups):
        g = groups[base]
        print(f"| `{base}` | {len(g)} | {span([x[0] for x in g])} | {span([x[1] for x in g])} | "
              f"{span([x[2] for x in g])} | {span([x[3] for x in g])} |")

if __name__ == "__main__":
    main()
