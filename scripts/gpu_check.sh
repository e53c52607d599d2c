#!/usr/bin/env bash
# One command for a GPU machine (issue §2), from a fresh clone:
#   1. checks that an NVIDIA GPU is visible (exit 2 with a message otherwise: there is no CPU-only mode; on a CPU
#      machine run `bash scripts/test.sh`, where every CUDA variant skips with its reason);
#   2. builds the CUDA extension for the visible GPU(s): FORCE_CUDA=1, TORCH_CUDA_ARCH_LIST from their compute
#      capability, through scripts/bootstrap.sh (venv, torch 2.14.1, the build). nvcc: $CUDA_HOME/bin/nvcc, else the
#      one on PATH, else NVIDIA's nvcc wheel (cuda-toolkit[nvcc], the version torch's own CUDA libraries come from)
#      installed into the venv;
#   3. runs the whole test suite (bash scripts/test.sh): every op test's cuda variant, the CUDA-graph and
#      determinism tests, and the NCCL variants of the distributed tests where enough GPUs are visible;
#   4. runs the benchmarks with --device cuda (log-probs at TP=1, and TP=2 on NCCL with >= 2 GPUs; rollout
#      correction), with the % of the HBM peak of the detected GPU;
#   5. writes one markdown report: build/gpu_check/report.md (the logs beside it).
# Exit status: 0 when the build, every test and both benchmarks passed; 1 otherwise (the report is written anyway);
# 2 when no GPU is visible. Environment: GPU_CHECK_OUT (report folder), GPU_CHECK_PEAK_GBPS (HBM peak to use when
# the GPU is not one the script knows), TORCH_CUDA_ARCH_LIST (overrides the detected one), MAX_JOBS, CUDA_HOME.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${GPU_CHECK_OUT:-build/gpu_check}
start=$(date +%s)

no_gpu() {
  echo "gpu_check: no GPU visible: $1" >&2
  echo "gpu_check: this script needs an NVIDIA GPU and its driver. On a CPU-only machine run 'bash scripts/test.sh'" \
       "(the CUDA variants of the tests skip there with a reason)." >&2
  exit 2
}

# ------------------------------------------------------------------------------------------- 1. a GPU?
command -v nvidia-smi >/dev/null 2>&1 || no_gpu "nvidia-smi is not installed (no NVIDIA driver on this machine)"
if ! gpus=$(nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader 2>&1); then
  no_gpu "nvidia-smi failed: $gpus"
fi
[ -n "$gpus" ] || no_gpu "nvidia-smi lists no device"
if [ "${CUDA_VISIBLE_DEVICES-unset}" = "" ] || [ "${CUDA_VISIBLE_DEVICES-unset}" = "-1" ]; then
  no_gpu "CUDA_VISIBLE_DEVICES='${CUDA_VISIBLE_DEVICES}' hides every GPU"
fi
mkdir -p "$OUT"
echo "gpu_check: GPUs (nvidia-smi):"
echo "$gpus" | sed 's/^/  /'

# ------------------------------------------------------------------------------------------- 2. build for them
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  caps=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | tr -d ' ' | grep -E '^[0-9]+\.[0-9]+$' \
         | sort -u | paste -sd ';' -)
  if [ -z "$caps" ] && [ -x .venv/bin/python ]; then  # older drivers: ask torch, if a venv is already there
    caps=$(.venv/bin/python -c "import torch; print(';'.join(sorted({'%d.%d' % torch.cuda.get_device_capability(i)
      for i in range(torch.cuda.device_count())})))" 2>/dev/null || true)
  fi
  if [ -z "$caps" ]; then
    echo "gpu_check: could not read the GPUs' compute capability; building for 8.0;9.0 (set TORCH_CUDA_ARCH_LIST)" >&2
    caps="8.0;9.0"
  fi
  export TORCH_CUDA_ARCH_LIST="$caps"
fi
export FORCE_CUDA=1
export MAX_JOBS=${MAX_JOBS:-$(nproc 2>/dev/null || echo 4)}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
TORCH_PIN=$(grep -o '"torch==[0-9.]*"' scripts/bootstrap.sh | head -n 1 | tr -d '"')
TORCH_PIN=${TORCH_PIN:-torch==2.14.1}

nvcc_source="$CUDA_HOME/bin/nvcc"
if [ ! -x "$CUDA_HOME/bin/nvcc" ]; then
  if command -v nvcc >/dev/null 2>&1; then
    CUDA_HOME=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
    export CUDA_HOME
    nvcc_source="PATH: $CUDA_HOME/bin/nvcc"
  else
    # No CUDA toolkit on the machine: NVIDIA's nvcc wheel, the version of the CUDA libraries torch came with.
    echo "gpu_check: no nvcc under CUDA_HOME or on PATH; installing NVIDIA's nvcc wheel into .venv"
    [ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv || { echo "gpu_check: cannot create .venv" >&2; exit 1; }
    .venv/bin/python -m pip install -q "$TORCH_PIN" ninja numpy || { echo "gpu_check: torch install failed" >&2; exit 1; }
    tk=$(.venv/bin/python -m pip show cuda-toolkit 2>/dev/null | awk '/^Version:/{print $2}')
    [ -n "$tk" ] || { echo "gpu_check: torch did not bring the cuda-toolkit package; install a CUDA toolkit" \
                           "(nvcc) and set CUDA_HOME" >&2; exit 1; }
    .venv/bin/python -m pip install -q "cuda-toolkit[nvcc,cudart,cccl]==$tk" \
      || { echo "gpu_check: installing cuda-toolkit[nvcc]==$tk failed; install a CUDA toolkit and set CUDA_HOME" >&2; exit 1; }
    CUDA_HOME=$(.venv/bin/python -c "import os, sysconfig, torch
print(os.path.join(sysconfig.get_paths()['purelib'], 'nvidia', 'cu' + torch.version.cuda.split('.')[0]))")
    export CUDA_HOME
    # The wheels' flat layout, completed to what nvcc.profile and the linker expect of a toolkit: the unversioned
    # libcudart.so, and targets/<arch>-linux/{include,lib}.
    if [ ! -e "$CUDA_HOME/lib/libcudart.so" ]; then
      so=$(ls "$CUDA_HOME"/lib/libcudart.so.* 2>/dev/null | head -n 1)
      [ -n "$so" ] && ln -sf "$(basename "$so")" "$CUDA_HOME/lib/libcudart.so"
    fi
    target=$([ "$(uname -m)" = aarch64 ] && echo sbsa-linux || echo "$(uname -m)-linux")
    if [ ! -e "$CUDA_HOME/targets/$target/include" ]; then
      mkdir -p "$CUDA_HOME/targets/$target"
      ln -sfn ../../include "$CUDA_HOME/targets/$target/include"
      ln -sfn ../../lib "$CUDA_HOME/targets/$target/lib"
    fi
    [ -x "$CUDA_HOME/bin/nvcc" ] || { echo "gpu_check: no nvcc at $CUDA_HOME/bin/nvcc after the install" >&2; exit 1; }
    nvcc_source="the cuda-toolkit[nvcc]==$tk wheel: $CUDA_HOME/bin/nvcc"
  fi
fi
export PATH="$CUDA_HOME/bin:$PATH"
echo "gpu_check: building the CUDA extension (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, nvcc: $nvcc_source," \
     "MAX_JOBS=$MAX_JOBS)"
if ! bash scripts/bootstrap.sh > "$OUT/build.log" 2>&1; then
  tail -n 60 "$OUT/build.log"
  echo "gpu_check: the build FAILED (log: $OUT/build.log)" >&2
  exit 1
fi
# shellcheck disable=SC1091
. .venv/bin/activate
if ! python - > "$OUT/env.json" 2> "$OUT/env.err" <<'PY'
import json, os, platform, subprocess
import torch
import rollout_corr_ext as rc

n = torch.cuda.device_count()
info = {
    "backend": rc.backend(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
    "cudnn": torch.backends.cudnn.version(), "nccl": ".".join(map(str, torch.cuda.nccl.version())) if n else None,
    "gpus": [{"index": i, "name": torch.cuda.get_device_name(i),
              "capability": "%d.%d" % torch.cuda.get_device_capability(i),
              "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1),
              "sms": torch.cuda.get_device_properties(i).multi_processor_count} for i in range(n)],
    "arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST"), "python": platform.python_version(),
    "host": platform.node(), "cpus": os.cpu_count(),
}
try:
    info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True).stdout.split()[0]
except Exception:  # noqa: BLE001
    info["driver"] = "?"
try:
    info["nvcc"] = subprocess.run([os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"), "--version"],
                                  capture_output=True, text=True).stdout.strip().splitlines()[-1]
except Exception:  # noqa: BLE001
    info["nvcc"] = "?"
print(json.dumps(info))
assert n > 0, "torch sees no CUDA device (CUDA_VISIBLE_DEVICES? a driver too old for this torch?)"
assert info["backend"] == "cuda", f"rollout_corr_ext backend is {info['backend']!r}, not 'cuda': the CUDA kernels were not built"
PY
then
  cat "$OUT/env.err" >&2
  if grep -q "sees no CUDA device" "$OUT/env.err"; then no_gpu "torch sees no CUDA device"; fi
  echo "gpu_check: the extension has no working CUDA backend (details above; build log: $OUT/build.log)" >&2
  exit 1
fi
ngpu=$(python -c "import torch; print(torch.cuda.device_count())")
name=$(python -c "import torch; print(torch.cuda.get_device_name(0))")

# HBM peak of the detected GPU (GB/s), for the % of peak columns; unknown GPUs: none (said so in the report).
peak=${GPU_CHECK_PEAK_GBPS:-$(python - "$name" <<'PY'
import sys
n = sys.argv[1].upper()
if "H200" in n:
    print(4800)          # H200 (SXM and NVL): 4.8 TB/s
elif "H100" in n and "PCIE" in n:
    print(2000)          # H100 PCIe: 2.0 TB/s
elif "H100" in n and ("SXM" in n or "HBM3" in n):
    print(3350)          # H100 SXM ("NVIDIA H100 80GB HBM3"): 3.35 TB/s
elif "A100" in n and "80GB" in n:
    print(2000)          # A100 80GB: 2.0 TB/s
PY
)}
echo "gpu_check: $ngpu GPU(s), GPU 0: $name; HBM peak: ${peak:-unknown}${peak:+ GB/s}"

# ------------------------------------------------------------------------------------------- 3. the test suite
echo "gpu_check: running the test suite (log: $OUT/tests.log)"
python -m pytest --collect-only -q -m cuda -p no:cacheprovider tests > "$OUT/cuda_tests.txt" 2>/dev/null || true
bash scripts/test.sh --junitxml="$OUT/junit.xml" -p no:cacheprovider > "$OUT/tests.log" 2>&1
test_rc=$?
tail -n 3 "$OUT/tests.log"

# ------------------------------------------------------------------------------------------- 4. the benchmarks
tps="1"
[ "$ngpu" -ge 2 ] && tps="1 2"
echo "gpu_check: benchmarks (--device cuda, TP=$tps)"
# shellcheck disable=SC2086
python benchmarks/bench_logprob.py --device cuda --tp $tps ${peak:+--peak-gbps $peak} > "$OUT/bench_logprob.txt" 2>&1
bench_lp_rc=$?
python benchmarks/bench_rollout_corr.py --device cuda --repeats 20 ${peak:+--peak-gbps $peak} \
  > "$OUT/bench_rollout_corr.txt" 2>&1
bench_rc_rc=$?

# ------------------------------------------------------------------------------------------- 5. the report
python - "$OUT" "$test_rc" "$bench_lp_rc" "$bench_rc_rc" "${peak:-}" "$(( $(date +%s) - start ))" <<'PY'
import collections, datetime, json, os, re, subprocess, sys
import xml.etree.ElementTree as ET

out, test_rc, lp_rc, rc_rc, peak, elapsed = sys.argv[1], *map(int, sys.argv[2:5]), sys.argv[5], int(sys.argv[6])
env = json.load(open(os.path.join(out, "env.json")))
try:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
except Exception:  # noqa: BLE001
    commit = "?"

cuda_ids = set()
for line in open(os.path.join(out, "cuda_tests.txt"), errors="replace"):
    if "::" in line:
        cuda_ids.add(line.strip())

cases = []  # (nodeid, outcome, message)
junit = os.path.join(out, "junit.xml")
if os.path.exists(junit):
    for tc in ET.parse(junit).getroot().iter("testcase"):
        cls, name = tc.get("classname", ""), tc.get("name", "")
        parts = cls.split(".")
        path = "/".join(parts) + ".py"
        if not os.path.exists(path):  # a test class: the last part is the class
            path = "/".join(parts[:-1]) + ".py::" + parts[-1]
        nodeid = f"{path}::{name}"
        outcome, msg = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                msg = (el.get("message") or "").strip().splitlines()[0][:200] if el.get("message") else ""
                break
        cases.append((nodeid, outcome, msg))


def counts(sel):
    c = collections.Counter(o for _, o, _ in sel)
    return f"{c['passed']} passed, {c['failed']} failed, {c['error']} errors, {c['skipped']} skipped"


is_cuda = lambda nid: nid in cuda_ids or "[cuda" in nid or "-cuda" in nid or "cuda]" in nid  # noqa: E731
is_nccl = lambda nid: "nccl" in nid  # noqa: E731
lines = []
w = lines.append
w(f"# GPU check report ({datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}, commit {commit})")
w("")
w(f"`bash scripts/gpu_check.sh` on `{env.get('host')}` ({env.get('cpus')} CPUs), {elapsed // 60} min {elapsed % 60} s.")
w("")
w("## Machine")
w("")
w("| GPU | name | compute capability | memory (GiB) | SMs |")
w("|---:|---|---|---:|---:|")
for g in env["gpus"]:
    w(f"| {g['index']} | {g['name']} | {g['capability']} | {g['memory_gib']} | {g['sms']} |")
w("")
peak_txt = (f"{peak} GB/s (by the name of GPU 0)" if peak and "GPU_CHECK_PEAK_GBPS" not in os.environ else
            f"{peak} GB/s (GPU_CHECK_PEAK_GBPS)" if peak else
            f"unknown for '{env['gpus'][0]['name']}' (known: H100 SXM 3350, H100 PCIe 2000, H200 4800, A100 80GB "
            f"2000 GB/s; set GPU_CHECK_PEAK_GBPS): no % of peak column")
w(f"- driver {env.get('driver')}; torch {env['torch']} (CUDA {env['torch_cuda']}, cuDNN {env['cudnn']}, NCCL "
  f"{env['nccl']}); nvcc: {env.get('nvcc')}; Python {env['python']}")
w(f"- extension backend: **{env['backend']}**, built for TORCH_CUDA_ARCH_LIST={env['arch_list']}")
w(f"- HBM peak used for the % columns: {peak_txt}")
w("")
w("## Tests (`bash scripts/test.sh`: the whole suite)")
w("")
if not cases:
    w(f"**No junit results** (pytest exit {test_rc}); see `tests.log`.")
else:
    cu = [c for c in cases if is_cuda(c[0])]
    nc = [c for c in cases if is_nccl(c[0])]
    w(f"| selection | result |")
    w("|---|---|")
    w(f"| all tests | {counts(cases)} |")
    w(f"| CUDA variants (marker `cuda`) | {counts(cu)} |")
    w(f"| NCCL variants ({len(env['gpus'])} GPU(s) visible; each needs one GPU per rank) | {counts(nc)} |")
    w(f"| CUDA graphs / determinism (tests/test_cuda_graphs_determinism.py) | "
      f"{counts([c for c in cases if 'test_cuda_graphs_determinism' in c[0]])} |")
    w("")
    w(f"pytest exit status: {test_rc}.")
    bad = [c for c in cases if c[1] in ("failed", "error")]
    if bad:
        w("")
        w(f"### Failures ({len(bad)})")
        w("")
        for nid, o, msg in bad[:80]:
            w(f"- `{nid}` ({o}): {msg}")
        if len(bad) > 80:
            w(f"- ... {len(bad) - 80} more (tests.log)")
    reasons = collections.Counter(m for _, o, m in cases if o == "skipped")
    if reasons:
        w("")
        w("### Skip reasons")
        w("")
        w("| tests | reason |")
        w("|---:|---|")
        for reason, k in reasons.most_common(20):
            w(f"| {k} | {reason or '(none given)'} |")
w("")


def bench_section(title, fname, rc):
    w(f"## {title}")
    w("")
    text = open(os.path.join(out, fname), errors="replace").read()
    if rc != 0:
        w(f"**FAILED** (exit {rc}); the end of its output:")
        w("")
        w("```")
        w("\n".join(text.strip().splitlines()[-30:]))
        w("```")
        w("")
        return
    # The tables verbatim (GB/s and % of the HBM peak are columns of their own), the other lines as fenced text.
    blocks, gap = [], True
    for line in text.splitlines():
        if re.match(r"^(\[rank\d+\]:)?[WIE]\d{4} ", line):  # torch's log lines
            continue
        if not line.strip():  # a blank line ends a block
            gap = True
            continue
        kind = "table" if line.startswith("|") else "text"
        if blocks and blocks[-1][0] == kind and not gap:
            blocks[-1][1].append(line)
        else:
            blocks.append((kind, [line]))
        gap = False
    for kind, content in blocks:
        w("\n".join(content) if kind == "table" else "```\n" + "\n".join(content) + "\n```")
        w("")


bench_section("Benchmark: vocab-parallel log-probs (`benchmarks/bench_logprob.py --device cuda`)", "bench_logprob.txt",
              lp_rc)
bench_section("Benchmark: rollout correction (`benchmarks/bench_rollout_corr.py --device cuda`)",
              "bench_rollout_corr.txt", rc_rc)
w("Logs beside this report: build.log, tests.log, junit.xml, bench_logprob.txt, bench_rollout_corr.txt.")
open(os.path.join(out, "report.md"), "w").write("\n".join(lines) + "\n")
PY
report_rc=$?
echo "gpu_check: report: $OUT/report.md (finished in $(( $(date +%s) - start )) s)"
if [ $test_rc -ne 0 ] || [ $bench_lp_rc -ne 0 ] || [ $bench_rc_rc -ne 0 ] || [ $report_rc -ne 0 ]; then
  echo "gpu_check: FAILED (tests exit $test_rc, bench_logprob exit $bench_lp_rc, bench_rollout_corr exit $bench_rc_rc," \
       "report exit $report_rc)" >&2
  exit 1
fi
echo "gpu_check: all passed"
