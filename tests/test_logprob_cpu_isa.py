"""The CPU log-prob kernels' two SIMD paths: the AVX-512 copy (16 lanes, used when the CPU has it) and the 8-lane
target_clones (AVX2 / baseline; forced with ROLLOUT_CORR_CPU_ISA=avx2). Both widen every bf16 / fp16 bit pattern to
the exact fp32 value, narrow bf16 gradients with torch's round-to-nearest-even, and give the same log-probs,
entropies and gradients to fp32 rounding. Each path runs in its own process (the ISA is chosen once per process).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

import rollout_corr_ext as rc

pytestmark = pytest.mark.skipif(rc.backend() == "reference", reason="needs the compiled CPU kernels")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = r'''
import json, sys, torch
import rollout_corr_ext as rc
from rollout_corr_ext import ops, fallback

out = {}
bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
for name, dt in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
    vals = bits.view(dt)
    # 32 copies per row: the vector loops (8 and 16 lanes) convert them; the row max is the value itself
    x = vals.unsqueeze(1).expand(65536, 32).contiguous()
    rec = ops.vocab_row_stats(x, torch.full((65536,), -100), 0, 32, 1.0, -100, False)
    r = rec[fallback.header_len(torch.float32):].view(65536, -1)
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


@pytest.fixture(scope="module")
def paths():
    return {"default (AVX-512 where available)": _run(None), "avx2 clones": _run("avx2")}


def test_every_16_bit_pattern_widens_exactly_on_both_paths(paths):
    for path, out in paths.items():
        for key in ("fp16_widen_exact", "bf16_widen_exact", "fp16_nan_poisons", "bf16_nan_poisons",
                    "bf16_narrow_is_torch_rounding"):
            assert out[key], (path, key)


def test_log_probs_without_entropy_sums_are_the_same_bits_on_both_paths(paths):
    for path, out in paths.items():
        for name in ("fp32", "bf16", "fp16", "fp64"):
            assert out[name + "_no_entropy_same_logp"], (path, name)


def test_both_paths_agree(paths):
    a, b = (out["results"] for out in paths.values())
    for name in a:
        for i, what in enumerate(("logp", "entropy", "grad")):
            x, y = torch.tensor(a[name][i], dtype=torch.float64), torch.tensor(b[name][i], dtype=torch.float64)
            assert torch.equal(x.isinf(), y.isinf()), (name, what)
            tol = 1e-12 if name == "fp64" else (1e-5 if what != "grad" or name == "fp32" else 1e-2)
            torch.testing.assert_close(x, y, rtol=tol, atol=tol, msg=f"{name} {what}")
