"""The CPU rollout-correction kernels follow the one ISA choice of every CPU kernel (``ops.cpu_isa()``: AVX-512, AVX2 +
FMA or the x86-64 baseline, ROLLOUT_CORR_CPU_ISA narrows it): each copy runs in its own process and its weights,
masks and every metric match the independent fp64 oracle (rollout_corr_testing.rollout_oracle), for token / sequence /
geometric IS, token and sequence RS criteria, the veto and packed sequences."""

import os
import subprocess
import sys

import pytest
import torch

import rollout_corr_ext as rc
from rollout_corr_testing.rollout_oracle import oracle_for_config
from rollout_corr_testing.rc_testutil import assert_weights_mask, compare_metrics, make_inputs

pytestmark = pytest.mark.skipif(rc.backend() == "fallback", reason="needs the compiled CPU kernels")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONFIGS = {
    "token_tis": dict(rollout_is="token", rollout_is_threshold=2.0),
    "seq_is_rs": dict(rollout_is="sequence", rollout_is_threshold=5.0, rollout_rs="seq_sum_k1",
                      rollout_rs_threshold="0.5_2.0"),
    "geo_rs_veto": dict(rollout_is="geometric", rollout_is_threshold="0.5_2.0", rollout_rs="token_k1,seq_max_k3",
                        rollout_rs_threshold="0.5_2.0,0.5", rollout_token_veto_threshold=1e-3),
}

_CHILD = r'''
import sys, torch
import rollout_corr_ext as rc
from rollout_corr_ext import ops
from rollout_corr_testing.rc_testutil import make_inputs
configs = {configs!r}
out = {{"isa": ops.cpu_isa()}}
lp, rlp, mask = make_inputs(37, 517, seed=7, pad_rows=(3,))
for name, kw in configs.items():
    res = rc.compute_rollout_correction(lp, rlp, mask, rc.RolloutCorrectionConfig(**kw))
    out[name] = (res.weights, res.response_mask, {{k: v.double() for k, v in res.metrics.items()}})
torch.save(out, sys.argv[1])
'''


@pytest.mark.parametrize("isa", [None, "avx2", "baseline"])
def test_every_cpu_copy_matches_the_fp64_oracle(isa, tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("ROLLOUT_CORR_CPU_ISA", None)
    if isa is not None:
        env["ROLLOUT_CORR_CPU_ISA"] = isa
    path = tmp_path / "out.pt"
    proc = subprocess.run([sys.executable, "-c", _CHILD.format(configs=CONFIGS), str(path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = torch.load(path, weights_only=True)
    if isa is not None:
        assert out["isa"] in (isa, "baseline"), out["isa"]  # the asked copy, or narrower on a CPU without it
    lp, rlp, mask = make_inputs(37, 517, seed=7, pad_rows=(3,))
    for name, kw in CONFIGS.items():
        weights, new_mask, metrics = out[name]
        cfg = rc.RolloutCorrectionConfig(**kw)
        w, m, met = oracle_for_config(lp.double(), rlp.double(), mask, cfg)
        errors = compare_metrics(metrics, met, torch.float32)
        assert not errors, (out["isa"], name, errors)

        class _Res:  # the fields assert_weights_mask reads
            pass
        res = _Res()
        res.weights, res.response_mask = weights, new_mask
        assert_weights_mask(res, w, m, torch.float32)
