"""The CPU log-prob kernels' SIMD copies: AVX-512 (16 lanes), AVX2 + FMA (8 lanes) and the x86-64 baseline (4 lanes),
the widest the CPU runs picked once per process (ROLLOUT_CORR_CPU_ISA=avx2 or baseline narrows it). On every copy
the CPU has: every bf16 / fp16 bit pattern widens to the exact fp32 value, bf16 gradients narrow with torch's
round-to-nearest-even, a row with one finite logit gives log p = 0 and entropy 0 exactly (the AVX-512 and AVX2
copies take an offset out of their sums), the block-merge stress rows stay within a few fp32 ulp, and log-probs,
entropies and gradients match the fp64 oracle with the suite's tolerances. Each copy runs in its own process.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

import rollout_corr_ext as rc
from rollout_corr_testing.logprob_oracle import log_probs_dense
from rollout_corr_testing.tolerances import ROW_ROUNDING_TOL, ROW_ROUNDING_TOL_NO_FMA, grad_tol, output_tol

pytestmark = pytest.mark.skipif(rc.backend() == "fallback", reason="needs the compiled CPU kernels")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = r'''
import json, sys, torch
import rollout_corr_ext as rc
from rollout_corr_ext import _layout as LY
from rollout_corr_ext import ops, fallback

out = {"isa": ops.cpu_isa()}
bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
for name, dt in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
    vals = bits.view(dt)
    # 32 copies per row: the vector loops (8 and 16 lanes) convert them; the row max is the value itself
    x = vals.unsqueeze(1).expand(65536, 32).contiguous()
    rec = ops.vocab_row_stats(x, torch.full((65536,), -100), 0, 32, 1.0, -100, False)
    r = rec[LY.header_len(torch.float32):].view(65536, -1)
    ref = vals.float()
    finite = ~ref.isnan()
    out[name + "_widen_exact"] = bool(torch.equal(r[finite, 0].view(torch.int32), ref[finite].view(torch.int32)))
    out[name + "_nan_poisons"] = bool(r[~finite, 1].isnan().all())
g = torch.Generator().manual_seed(3)
base = torch.randn(67, 1337, generator=g) * 4
base[0, 5] = float("-inf")
target = torch.randint(0, 1337, (67,), generator=g)
target[2] = -100
w = torch.randn(67, generator=g)
res = {}
for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp64", torch.float64)):
    x = base.to(dt).detach().clone().requires_grad_(True)
    lp, ent = rc.vocab_parallel_log_probs(x, target, return_entropy=True, temperature=0.8)
    (lp * w + ent).sum().backward()
    res[name] = [lp.double().tolist(), ent.double().tolist(), x.grad.double().flatten().tolist()]
    # without the entropy sums (with_entropy=False): the same log-probs, bit for bit
    lp_only = rc.vocab_parallel_log_probs(x.detach(), target, temperature=0.8)
    out[name + "_no_entropy_same_logp"] = bool(torch.equal(lp_only, lp.detach()))
    if dt == torch.bfloat16:
        # The backward on the bf16 logits gives the gradient of the same logits widened to fp32, with the same row
        # state, rounded by torch's rule. (The same row state: fp32 and bf16 rows are summed in different lane orders,
        # so their forwards may differ in the last fp32 bit.)
        xb = base.to(dt)
        rec = ops.vocab_row_stats(xb, target, 0, 1337, 1 / 0.8, -100, False)
        state = ops.merge_row_stats(rec.unsqueeze(0), target, -100, 1337, 1 / 0.8, False)[3]
        gh = torch.ones(67)
        g16 = ops.logprob_backward(w, gh, None, xb, target, state, 0, 1337, 1 / 0.8, -100)
        g32 = ops.logprob_backward(w, gh, None, xb.float(), target, state, 0, 1337, 1 / 0.8, -100)
        out["bf16_narrow_is_torch_rounding"] = bool(g16.dtype == dt and torch.equal(g16, g32.to(dt)))
out["results"] = res
# One finite logit per row, the rest -inf or far below: log p = 0 and entropy = 0 exactly, in a vector loop or a
# block's scalar tail, at maxima whose product with log2(e)/T is not exact in fp32.
one_hot_exact = {}
for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
    ok_all = True
    for temperature in (1.0, 0.7, 1.3):
        rows, tg = [], []
        big = (6.02e6, 3.1e38) if dt != torch.float16 else (6.0e4, 6.5e4)
        for v in (3.7, -12.3, 0.1, 1000.1, *big):
            for pos in (0, 100, 2047, 2090):
                for rest in (float("-inf"), v - 200.0 * temperature):
                    row = torch.full((2100,), rest, dtype=torch.float64)
                    row[pos] = v
                    rows.append(row)
                    tg.append(pos)
        x = torch.stack(rows).to(dt)
        top, low = x.double().max(1).values, x.double().min(1).values
        keep = torch.isfinite(top) & ((top - low) / temperature > 150.0)
        lp, ent = rc.vocab_parallel_log_probs(x[keep], torch.tensor(tg)[keep], return_entropy=True,
                                              temperature=temperature)
        ok_all &= bool((lp == 0).all() and (ent == 0).all())
    one_hot_exact[name] = ok_all
out["one_hot_exact"] = one_hot_exact
# The block-merge stress rows: the worst |ours - fp64| / (1 + |fp64|) over logp and entropy, per dtype.
from rollout_corr_testing.logprob_samples import merge_stress_rows
from rollout_corr_testing.logprob_oracle import log_probs_dense
rows, tg = merge_stress_rows()
merge_err = {}
for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
    worst = 0.0
    for temperature in (1.0, 0.3, 2.5):
        x = rows.to(dt)
        lp, ent = rc.vocab_parallel_log_probs(x, tg, return_entropy=True, temperature=temperature)
        ref_lp, ref_ent, _ = log_probs_dense(x.double(), tg, temperature=temperature)
        for got, ref in ((lp, ref_lp), (ent, ref_ent)):
            worst = max(worst, ((got.double() - ref).abs() / (1 + ref.abs())).max().item())
    merge_err[name] = worst
out["merge_err"] = merge_err
print("RESULT " + json.dumps(out))
'''


def _run(isa):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("ROLLOUT_CORR_CPU_ISA", None)
    if isa:
        env["ROLLOUT_CORR_CPU_ISA"] = isa
    proc = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


PATHS = {"default (the widest the CPU runs)": None, "avx2": "avx2", "baseline": "baseline"}


@pytest.fixture(scope="module")
def paths():
    return {name: _run(isa) for name, isa in PATHS.items()}


def test_the_isa_is_the_widest_unless_narrowed(paths):
    order = ["baseline", "avx2", "avx512"]
    widest = paths["default (the widest the CPU runs)"]["isa"]
    assert widest in order
    for path, isa in PATHS.items():
        if isa is not None:  # narrowed: the asked copy, or the widest if the CPU runs less
            assert paths[path]["isa"] == order[min(order.index(isa), order.index(widest))], path
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if " avx512bw" in flags and " avx512dq" in flags and " avx512vl" in flags:
        assert widest == "avx512"
    elif " avx2" in flags and " fma" in flags:
        assert widest == "avx2"


def test_an_unknown_isa_name_is_reported_and_ignored(paths):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               ROLLOUT_CORR_CPU_ISA="avx1024")
    proc = subprocess.run([sys.executable, "-c", "from rollout_corr_ext import ops; print('ISA', ops.cpu_isa())"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ROLLOUT_CORR_CPU_ISA=avx1024 is not one of avx512, avx2, baseline" in proc.stderr
    assert f"ISA {paths['default (the widest the CPU runs)']['isa']}" in proc.stdout


def test_every_16_bit_pattern_widens_exactly_on_every_path(paths):
    for path, out in paths.items():
        for key in ("fp16_widen_exact", "bf16_widen_exact", "fp16_nan_poisons", "bf16_nan_poisons",
                    "bf16_narrow_is_torch_rounding"):
            assert out[key], (path, key)


def test_log_probs_without_entropy_sums_are_the_same_bits_on_every_path(paths):
    for path, out in paths.items():
        for name in ("fp32", "bf16", "fp16", "fp64"):
            assert out[name + "_no_entropy_same_logp"], (path, name)


def test_a_row_with_one_finite_logit_is_exact_on_every_path(paths):
    for path, out in paths.items():
        for name, exact in out["one_hot_exact"].items():
            assert exact, (path, name)


def test_block_merge_keeps_fp32_accuracy_on_every_path(paths):
    """merge_stress_rows (test_logprob.py's test_block_merge_keeps_fp32_accuracy, there on the widest copy only)."""
    for path, out in paths.items():
        tol = ROW_ROUNDING_TOL_NO_FMA if out["isa"] == "baseline" else ROW_ROUNDING_TOL
        for name, err in out["merge_err"].items():
            assert err <= tol, (path, name, err)


def _oracle():
    """The child's inputs rebuilt here, and their log-probs, entropies and gradients in fp64."""
    g = torch.Generator().manual_seed(3)
    base = torch.randn(67, 1337, generator=g) * 4
    base[0, 5] = float("-inf")
    target = torch.randint(0, 1337, (67,), generator=g)
    target[2] = -100
    w = torch.randn(67, generator=g)
    out = {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16),
                     ("fp64", torch.float64)):
        x = base.to(dt).double().requires_grad_(True)
        lp, ent, _ = log_probs_dense(x, target, temperature=0.8)
        (lp * w.double() + ent).sum().backward()
        out[name] = (dt, [lp.detach(), ent.detach(), x.grad.flatten()])
    return out


def test_every_path_matches_the_fp64_oracle(paths):
    oracle = _oracle()
    for path, out in paths.items():
        for name, (dt, refs) in oracle.items():
            for what, got, ref in zip(("logp", "entropy", "grad"), out["results"][name], refs):
                got = torch.tensor(got, dtype=torch.float64)
                tol = grad_tol(dt) if what == "grad" else output_tol(dt)
                if what == "grad" and dt != torch.float64:
                    ref = ref.to(dt).double()  # the gradient comes back in the logits dtype: compare after one rounding
                torch.testing.assert_close(got, ref, **tol, msg=f"{path}: {name} {what}")


def test_every_path_agrees_with_the_widest(paths):
    widest, *others = (out["results"] for out in paths.values())
    for other in others:
        for name in widest:
            for i, what in enumerate(("logp", "entropy", "grad")):
                x = torch.tensor(widest[name][i], dtype=torch.float64)
                y = torch.tensor(other[name][i], dtype=torch.float64)
                assert torch.equal(x.isinf(), y.isinf()), (name, what)
                tol = 1e-12 if name == "fp64" else (1e-5 if what != "grad" or name == "fp32" else 1e-2)
                torch.testing.assert_close(x, y, rtol=tol, atol=tol, msg=f"{name} {what}")
