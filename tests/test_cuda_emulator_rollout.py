"""The rollout-correction CUDA kernels, run thread by thread on the CUDA emulator, against reference.py.

The emulator compiles csrc/cuda/rollout_correction_kernels.cuh unchanged with g++ (through the same host driver
as the CUDA launchers). Sweeps: IS levels and modes, token and sequence RS criteria, the veto, non-finite
exclusion, input and mask dtypes, block sizes, both turnstile schedules (a missing barrier reads poisoned shared
memory) and grids smaller than the row count (grid-stride loops, several scratch rows).
"""

from __future__ import annotations

import pytest
import torch

from rollout_corr_testing.rc_testutil import TOL, compare_metrics, make_inputs
from rollout_corr_ext import RolloutCorrectionConfig as Cfg
from rollout_corr_ext import reference as R
from rollout_corr_ext.correction import finalize_metrics, pack_params
from rollout_corr_testing.cuda_emulator.loader import load_emulator


@pytest.fixture(scope="module")
def emu():
    load_emulator()
    return torch.ops.rollout_corr_emu


CONFIGS = [
    dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1,seq_mean_k3,token_k2,token",
         rollout_rs_threshold="0.7_1.3,0.02,0.02,0.8_1.25", rollout_token_veto_threshold=0.6),
    dict(rollout_is="sequence", rollout_is_threshold="0.5_5.0", rollout_rs="seq_sum_k1,seq_max_k2,token_k3",
         rollout_rs_threshold="0.3_3.0,0.05,0.02"),
    dict(rollout_is="geometric", rollout_is_threshold=1.05, rollout_is_mode="mask",
         rollout_rs="geometric,sequence,seq_sum_k3", rollout_rs_threshold="0.99_1.01,0.2_5.0,0.5"),
    dict(rollout_is=None, rollout_rs=None),
]
KNOBS = [
    dict(),  # the launcher's own choices
    dict(threads=32, schedule=1, max_blocks=2),
    dict(threads=64, schedule=1),
    dict(threads=128, max_blocks=1),
]
#: (rows, cols): ragged, a single token per row, more rows than blocks.
SHAPES = [(6, 70), (3, 1), (9, 33)]


def _check_pass_outputs(emu, lp, rlp, mask, cfg, knobs, exclude=False, dtype=torch.float32):
    params = pack_params(cfg, exclude)
    st_ref = R.rollout_seq_stats(lp, rlp, mask, params)
    st = emu.rollout_seq_stats(lp, rlp, mask, params, **knobs)
    tol = TOL[torch.float64 if lp.dtype == torch.float64 else torch.float32]
    torch.testing.assert_close(st, st_ref, rtol=tol["rtol"] * 10, atol=tol["atol"] * 10, equal_nan=True)
    w_ref, m_ref, s_ref, x_ref = R.rollout_token_pass(lp, rlp, mask, st_ref, params, True)
    w, m, s, x = emu.rollout_token_pass(lp, rlp, mask, st_ref, params, True, **knobs)
    assert m.dtype == mask.dtype and torch.equal(m, m_ref)
    torch.testing.assert_close(w, w_ref, **tol)
    torch.testing.assert_close(s, s_ref, rtol=1e-5 if lp.dtype != torch.float64 else 1e-10, atol=1e-5,
                               equal_nan=True)
    torch.testing.assert_close(x, x_ref, rtol=1e-6, atol=1e-7)
    return w, m, s, x


@pytest.mark.parametrize("cfg_i", range(len(CONFIGS)))
def test_passes_match_reference(emu, cfg_i):
    cfg = Cfg(**CONFIGS[cfg_i])
    scale = 0.2 if CONFIGS[cfg_i]["rollout_is"] in ("token", None) else 0.05
    for si, (rows, cols) in enumerate(SHAPES):
        for ki, knobs in enumerate(KNOBS):
            lp, rlp, mask = make_inputs(rows, cols, seed=10 * si + ki, scale=scale, pad_rows=(1,))
            _check_pass_outputs(emu, lp, rlp, mask, cfg, knobs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32])
def test_dtypes(emu, dtype, mask_dtype):
    cfg = Cfg(**CONFIGS[0])
    lp, rlp, mask = make_inputs(5, 40, seed=3, pad_rows=(2,), dtype=dtype)
    _check_pass_outputs(emu, lp, rlp, mask.to(mask_dtype), cfg, dict(threads=32, schedule=1, max_blocks=2))


def test_nonfinite_excluded(emu):
    lp, rlp, mask = make_inputs(4, 24, seed=5)
    mask[1, 3] = True
    lp[1, 3] = float("nan")
    rlp[2, 0] = float("-inf")
    mask[2, 0] = True
    _check_pass_outputs(emu, lp, rlp, mask, Cfg(**CONFIGS[1]), dict(threads=32, schedule=1), exclude=True)


def test_metrics_from_emulated_partials_match_dense_oracle(emu):
    for cfg_kw in CONFIGS:
        cfg = Cfg(**cfg_kw)
        lp, rlp, mask = make_inputs(7, 48, seed=11, scale=0.1, pad_rows=(0,))
        params = pack_params(cfg)
        st = emu.rollout_seq_stats(lp, rlp, mask, params, threads=64, schedule=1)
        w, m, s, x = emu.rollout_token_pass(lp, rlp, mask, st, params, True, threads=64, schedule=1, max_blocks=3)
        w_d, m_d, met = R.rollout_correction_dense(lp.double(), rlp.double(), mask, cfg)
        errors = compare_metrics(finalize_metrics(s, x, cfg), met, torch.float32,
                                 skip=("batch_norm_factor",))
        assert not errors, "\n".join(errors)
        assert torch.equal(m, m_d)


def test_passes_on_a_rank_without_rows(emu):
    """A DP rank may hold no rows: neutral partials (0 sums, -inf maxima), equal to the reference's."""
    lp, rlp, mask = (x[:0] for x in make_inputs(3, 16, seed=22))
    params = pack_params(Cfg(**CONFIGS[1]))
    st = emu.rollout_seq_stats(lp, rlp, mask, params)
    assert torch.equal(st, R.rollout_seq_stats(lp, rlp, mask, params))
    out = emu.rollout_token_pass(lp, rlp, mask, st, params, True)
    ref = R.rollout_token_pass(lp, rlp, mask, st, params, True)
    for a, b in zip(out, ref):
        assert a.shape == b.shape and torch.equal(a, b)
    assert (out[2] == 0).all() and (out[3] == -float("inf")).all()


@pytest.mark.parametrize("lp_dtype,rlp_dtype", [(torch.bfloat16, torch.float32), (torch.float64, torch.float16),
                                               (torch.float16, torch.bfloat16)], ids=str)
def test_pipeline_on_emulated_kernels_with_mixed_dtypes(emu, monkeypatch, lp_dtype, rlp_dtype):
    """compute_rollout_correction with the emulated CUDA kernels as its passes: a mix of input dtypes is promoted to
    the wider one (fp16 + bf16 -> fp32) before the kernels, which take one dtype and refuse a mix by name."""
    from rollout_corr_ext import compute_rollout_correction, ops

    lp, rlp, mask = make_inputs(9, 40, seed=21, scale=0.2, pad_rows=(4,))
    lp, rlp = lp.to(lp_dtype), rlp.to(rlp_dtype)
    cfg = Cfg(**CONFIGS[0])
    with pytest.raises(RuntimeError, match="rollout_log_prob must have log_prob's dtype"):
        emu.rollout_seq_stats(lp, rlp, mask, pack_params(cfg))
    monkeypatch.setattr(ops, "rollout_seq_stats",
                        lambda *a: emu.rollout_seq_stats(*a, threads=32, schedule=1, max_blocks=2))
    monkeypatch.setattr(ops, "rollout_token_pass",
                        lambda *a: emu.rollout_token_pass(*a, threads=64, schedule=1, max_blocks=3))
    res = compute_rollout_correction(lp, rlp, mask, cfg)
    w_d, m_d, met = R.rollout_correction_dense(lp.double(), rlp.double(), mask, cfg)
    acc = torch.float64 if torch.float64 in (lp_dtype, rlp_dtype) else torch.float32
    assert res.weights.dtype == acc
    errors = compare_metrics(res.metrics, met, acc)
    assert not errors, "\n".join(errors)
    assert torch.equal(res.response_mask, m_d)
    torch.testing.assert_close(res.weights, w_d.to(acc), **TOL[acc])


# Planted bugs: each must be caught (a missing barrier around the block reduction, an off-by-one row sweep).
MUTANTS = {
    "missing_syncthreads_partials": (
        "    for (int k = 0; k < K; ++k) red[warp * (N + K) + N + k] = m[k];\n  }\n  __syncthreads();",
        "    for (int k = 0; k < K; ++k) red[warp * (N + K) + N + k] = m[k];\n  }",
    ),
    "missing_syncthreads_results": (
        "      out_max[k - N] = t;\n    }\n  }\n  __syncthreads();",
        "      out_max[k - N] = t;\n    }\n  }",
    ),
    "off_by_one_sweep": (
        "for (int64_t t = threadIdx.x; t < p.cols; t += blockDim.x) {\n      const mask_t mv",
        "for (int64_t t = threadIdx.x; t + 1 < p.cols; t += blockDim.x) {\n      const mask_t mv",
    ),
}

_MUTANT_CHECK = r"""
import sys, torch
sys.path[:0] = [{root!r}]
from rollout_corr_testing.cuda_emulator.loader import load_emulator
load_emulator(kernel_override_dir={dir!r})
from rollout_corr_testing.rc_testutil import make_inputs
from rollout_corr_ext import RolloutCorrectionConfig as Cfg, reference as R
from rollout_corr_ext.correction import pack_params
cfg = Cfg(rollout_is="token", rollout_rs="token_k1,seq_mean_k3", rollout_rs_threshold="1.3,0.02")
lp, rlp, m = make_inputs(4, 200, seed=1)
m[1] = True  # a full row (its last token is valid)
lp[1] = rlp[1] + 0.1
p = pack_params(cfg)
caught = False
try:
    for sched in (0, 1):
        st_ref = R.rollout_seq_stats(lp, rlp, m, p)
        st = torch.ops.rollout_corr_emu.rollout_seq_stats(lp, rlp, m, p, threads=128, schedule=sched)
        out = torch.ops.rollout_corr_emu.rollout_token_pass(lp, rlp, m, st_ref, p, True, threads=128, schedule=sched)
        ref = R.rollout_token_pass(lp, rlp, m, st_ref, p, True)
        ok = (torch.allclose(st, st_ref, rtol=1e-4, atol=1e-4) and torch.equal(out[1], ref[1])
              and torch.allclose(out[2], ref[2], rtol=1e-4, atol=1e-4) and torch.allclose(out[3], ref[3]))
        caught |= not ok
except Exception as e:  # an emulator error is a detection too
    caught = True
print("DETECTED" if caught else "MISSED")
"""


@pytest.mark.slow
def test_planted_bugs_are_caught(tmp_path):
    import shutil
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    from rollout_corr_testing.cuda_emulator.loader import ROOT

    def run(name):
        old, new = MUTANTS[name]
        d = tmp_path / name
        d.mkdir()
        for src in (ROOT / "csrc" / "cuda").glob("*.cuh"):
            shutil.copy(src, d / src.name)
        f = d / "rollout_correction_kernels.cuh"
        text = f.read_text()
        assert text.count(old) == 1, f"mutant {name}: pattern not found"
        f.write_text(text.replace(old, new))
        script = _MUTANT_CHECK.format(root=str(ROOT), dir=str(d))
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900)
        return name, proc

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(run, sorted(MUTANTS)))
    for name, proc in results:
        assert "DETECTED" in proc.stdout, f"mutant {name} was not caught:\n{(proc.stdout + proc.stderr)[-3000:]}"
