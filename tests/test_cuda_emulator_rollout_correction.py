"""The rollout-correction CUDA kernels, run thread by thread on the CUDA emulator.

The emulator compiles csrc/cuda/rollout_correction_kernels.cuh unchanged with g++ (through the same host driver and
launch planning as the CUDA launchers). Pass by pass, the emulated kernels are compared with the pure-PyTorch
fallback of the same ops; the whole pipeline on the emulated kernels is compared with the independent oracle.
Sweeps: IS levels and modes, token and sequence RS criteria, the veto, non-finite exclusion, input and mask dtypes
(mixed too), block sizes, both turnstile schedules (a missing barrier reads poisoned shared memory) and grids
smaller than the row count (grid-stride loops, several scratch rows).
"""

from __future__ import annotations

import pytest
import torch

from rollout_corr_ext import RolloutCorrectionConfig as Cfg
from rollout_corr_ext import compute_rollout_correction, fallback
from rollout_corr_ext.correction import finalize_metrics, op_args
from rollout_corr_testing.backends import rollout_backend
from rollout_corr_testing.cuda_emulator.loader import load_emulator
from rollout_corr_testing.rc_testutil import TOL, compare_metrics, make_inputs
from rollout_corr_testing.rollout_oracle import oracle_for_config


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


def _check_pass_outputs(emu, lp, rlp, mask, cfg, knobs, exclude=False):
    args = op_args(cfg, exclude)
    st_ref = fallback.rollout_seq_stats(lp, rlp, mask, None, *args)
    st = emu.rollout_seq_stats(lp, rlp, mask, None, *args, **knobs)
    acc = torch.float64 if torch.float64 in (lp.dtype, rlp.dtype) else torch.float32
    tol = TOL[acc]
    torch.testing.assert_close(st, st_ref, rtol=tol["rtol"] * 10, atol=tol["atol"] * 10, equal_nan=True)
    w_ref, m_ref, s_ref, x_ref = fallback.rollout_token_pass(lp, rlp, mask, None, st_ref, *args, True)
    w, m, s, x = emu.rollout_token_pass(lp, rlp, mask, None, st_ref, *args, True, **knobs)
    assert m.dtype == mask.dtype and torch.equal(m, m_ref)
    torch.testing.assert_close(w, w_ref, **tol)
    torch.testing.assert_close(s, s_ref, rtol=1e-5 if acc != torch.float64 else 1e-10, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(x, x_ref, rtol=1e-6, atol=1e-7)
    return w, m, s, x


@pytest.mark.parametrize("cfg_i", range(len(CONFIGS)))
def test_passes_match_the_fallback(emu, cfg_i):
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


def test_strided_inputs_are_read_in_place(emu):
    """Transposed / sliced inputs go through the dtype-tagged views with their strides (no copy)."""
    lp, rlp, mask = make_inputs(7, 30, seed=8, pad_rows=(3,))
    lp_t = lp.t().contiguous().t()
    rlp_s = torch.cat([rlp, rlp], dim=1)[:, ::2]
    _check_pass_outputs(emu, lp_t, rlp_s.contiguous(), mask, Cfg(**CONFIGS[1]), dict(threads=32))
    _check_pass_outputs(emu, lp_t, torch.cat([rlp, rlp], dim=1)[:, :30], mask, Cfg(**CONFIGS[0]), dict(threads=64))


def test_nonfinite_excluded(emu):
    lp, rlp, mask = make_inputs(4, 24, seed=5)
    mask[1, 3] = True
    lp[1, 3] = float("nan")
    rlp[2, 0] = float("-inf")
    mask[2, 0] = True
    _check_pass_outputs(emu, lp, rlp, mask, Cfg(**CONFIGS[1]), dict(threads=32, schedule=1), exclude=True)


def test_bad_mask_values_are_counted(emu):
    """Mask values other than 0/1 land in the bad_mask column (the pipeline then raises naming the position)."""
    lp, rlp, mask = make_inputs(4, 24, seed=6)
    m = mask.float()
    m[2, 1] = 0.5
    m[3, 0] = float("nan")
    _check_pass_outputs(emu, lp, rlp, m, Cfg(**CONFIGS[0]), dict(threads=32))
    with rollout_backend("emulated", threads=32):
        with pytest.raises(ValueError, match=r"response_mask must hold only 0 and 1.*response_mask\[2, 1\] = 0.5"):
            compute_rollout_correction(lp, rlp, m, Cfg(**CONFIGS[0]))


def test_metrics_from_emulated_partials_match_dense_oracle(emu):
    for cfg_kw in CONFIGS:
        cfg = Cfg(**cfg_kw)
        lp, rlp, mask = make_inputs(7, 48, seed=11, scale=0.1, pad_rows=(0,))
        args = op_args(cfg)
        st = emu.rollout_seq_stats(lp, rlp, mask, None, *args, threads=64, schedule=1)
        w, m, s, x = emu.rollout_token_pass(lp, rlp, mask, None, st, *args, True, threads=64, schedule=1, max_blocks=3)
        w_d, m_d, met = oracle_for_config(lp.double(), rlp.double(), mask, cfg)
        errors = compare_metrics(finalize_metrics(s, x, cfg), met, torch.float32, skip=("batch_norm_factor",))
        assert not errors, "\n".join(errors)
        assert torch.equal(m, m_d)


def test_passes_on_a_rank_without_rows(emu):
    """A DP rank may hold no rows: neutral partials (0 sums, -inf maxima), equal to the fallback's."""
    lp, rlp, mask = (x[:0] for x in make_inputs(3, 16, seed=22))
    args = op_args(Cfg(**CONFIGS[1]))
    st = emu.rollout_seq_stats(lp, rlp, mask, None, *args)
    assert torch.equal(st, fallback.rollout_seq_stats(lp, rlp, mask, None, *args))
    out = emu.rollout_token_pass(lp, rlp, mask, None, st, *args, True)
    ref = fallback.rollout_token_pass(lp, rlp, mask, None, st, *args, True)
    for a, b in zip(out, ref):
        assert a.shape == b.shape and torch.equal(a, b)
    assert (out[2] == 0).all() and (out[3] == -float("inf")).all()


@pytest.mark.parametrize("lp_dtype,rlp_dtype", [(torch.bfloat16, torch.float32), (torch.float64, torch.float16),
                                               (torch.float16, torch.bfloat16)], ids=str)
def test_pipeline_on_emulated_kernels_with_mixed_dtypes(emu, lp_dtype, rlp_dtype):
    """compute_rollout_correction on the emulated kernels: each input is read in its own dtype (no promotion copy),
    the math runs in fp32 (fp64 when either input is fp64)."""
    lp, rlp, mask = make_inputs(9, 40, seed=21, scale=0.2, pad_rows=(4,))
    lp, rlp = lp.to(lp_dtype), rlp.to(rlp_dtype)
    cfg = Cfg(**CONFIGS[0])
    with rollout_backend("emulated", threads=32, schedule=1, max_blocks=2):
        res = compute_rollout_correction(lp, rlp, mask, cfg)
    w_d, m_d, met = oracle_for_config(lp.double(), rlp.double(), mask, cfg)
    acc = torch.float64 if torch.float64 in (lp_dtype, rlp_dtype) else torch.float32
    assert res.weights.dtype == acc
    errors = compare_metrics(res.metrics, met, acc)
    assert not errors, "\n".join(errors)
    assert torch.equal(res.response_mask, m_d)
    torch.testing.assert_close(res.weights, w_d.to(acc), **TOL[acc])


# Planted bugs: each must be caught (an off-by-one row sweep; each barrier around the block reduction is removed in
# turn by tests/test_cuda_emulator_races.py::test_every_syncthreads_is_necessary, which must catch every one).
MUTANTS = {
    "off_by_one_sweep": (
        "for (int64_t t = threadIdx.x; t < sp.len; t += blockDim.x) {\n      const int64_t col = sp.col0 + t;\n"
        "      const rc::TokenOut<acc_t> o",
        "for (int64_t t = threadIdx.x; t + 1 < sp.len; t += blockDim.x) {\n      const int64_t col = sp.col0 + t;\n"
        "      const rc::TokenOut<acc_t> o",
    ),
}

_MUTANT_CHECK = r"""
import sys, torch
sys.path[:0] = [{root!r}]
from rollout_corr_testing.cuda_emulator.loader import load_emulator
load_emulator(kernel_override_dir={dir!r}, sources=["emu_rollout_correction.cpp"])  # the family the mutants touch
from rollout_corr_testing.rc_testutil import make_inputs
from rollout_corr_ext import RolloutCorrectionConfig as Cfg, fallback
from rollout_corr_ext.correction import op_args
cfg = Cfg(rollout_is="token", rollout_rs="token_k1,seq_mean_k3", rollout_rs_threshold="1.3,0.02")
lp, rlp, m = make_inputs(4, 200, seed=1)
m[1] = True  # a full row (its last token is valid)
lp[1] = rlp[1] + 0.1
a = op_args(cfg)
caught = False
try:
    for sched in (0, 1):
        st_ref = fallback.rollout_seq_stats(lp, rlp, m, None, *a)
        st = torch.ops.rollout_corr_emu.rollout_seq_stats(lp, rlp, m, None, *a, threads=128, schedule=sched)
        out = torch.ops.rollout_corr_emu.rollout_token_pass(lp, rlp, m, None, st_ref, *a, True, threads=128, schedule=sched)
        ref = fallback.rollout_token_pass(lp, rlp, m, None, st_ref, *a, True)
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
