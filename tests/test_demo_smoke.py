"""Smoke run of the demo trainer (the README's main-job command) on both ranks: a few steps of every correction
setting under ``torchrun --nproc_per_node=2`` (gloo, TP=2), then the JSONL and the PNG must be there and sane."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core", reason="the demo is built on megatron-core's TP layers")
pytest.importorskip("matplotlib", reason="the demo writes a PNG with matplotlib (the 'demo' extra)")
pytest.importorskip("tqdm", reason="the demo shows a tqdm progress bar (the 'demo' extra)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = ["none", "token_tis", "seq_mis", "geo_rs", "bypass"]
STEPS = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_demo(tmp_path, out, *extra, settings=SETTINGS, steps=STEPS):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", os.path.join(ROOT, "examples", "demo_trainer.py"),
           f"--steps={steps}", "--prompts=4", "--group=4", "--stale=1", f"--settings={','.join(settings)}",
           f"--out-dir={out}", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=240)
    log = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, log  # torchrun returns 0 only when both ranks exit cleanly
    assert "wrote" in proc.stdout, log
    assert "rollout_corr_ext backend=" in proc.stdout, log  # the demo says which kernels it ran
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_demo_packed_gives_the_padded_curves(tmp_path):
    """--packed feeds the loss one token stream with cu_seqlens: the same run, to float rounding."""
    settings = ["token_tis", "geo_rs", "bypass"]
    padded = _run_demo(tmp_path, tmp_path / "padded", settings=settings, steps=3)
    packed = _run_demo(tmp_path, tmp_path / "packed", "--packed", settings=settings, steps=3)
    assert len(padded) == len(packed) == 3 * len(settings)
    for a, b in zip(padded, packed):
        assert a.keys() == b.keys()
        for k, v in a.items():
            if isinstance(v, float):
                assert b[k] == pytest.approx(v, rel=1e-5, abs=1e-7), (a["setting"], a["step"], k)


def test_demo_smoke_two_ranks(tmp_path):
    out = tmp_path / "demo"
    records = _run_demo(tmp_path, out)
    assert len(records) == STEPS * len(SETTINGS)
    assert [r["setting"] for r in records[: len(SETTINGS)]] == SETTINGS
    for r in records:
        for key in ("step", "reward", "exact_match", "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl",
                    "rollout_corr/kl", "rollout_corr/chi2_token", "demo/token_ratio_p05", "demo/token_ratio_p95"):
            assert key in r, f"{key} missing from {sorted(r)}"
        assert 0.0 <= r["reward"] <= 1.0
        assert r["demo/token_ratio_p05"] <= r["demo/token_ratio_p50"] <= r["demo/token_ratio_p95"]
    # The sampler is one step stale from step 1 on: pi_train != pi_rollout, so the mismatch metrics are not 0.
    late = [r for r in records if r["step"] >= 2]
    assert all(abs(r["rollout_corr/chi2_token"]) > 0 for r in late)
    # the correction settings that weight or reject report their own metrics
    assert any(k.startswith("rollout_corr/rollout_is") for r in records if r["setting"] == "token_tis" for k in r)

    png = (out / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
