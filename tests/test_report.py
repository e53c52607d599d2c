"""python -m rollout_corr_ext.report on a saved batch: the page and the numbers are written, and the numbers equal
loop oracles (position deciles, probability bins, version lags, worst rows)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    b, t = 6, 30
    lp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    # mismatch that grows along the response, worst in row 4
    growth = torch.linspace(0.005, 0.08, t, dtype=torch.float64)
    rlp = lp + growth * torch.randn(b, t, generator=g, dtype=torch.float64)
    rlp[4] = lp[4] + 0.5 * torch.randn(t, generator=g, dtype=torch.float64)
    lengths = torch.tensor([30, 12, 0, 25, 30, 7])
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    versions = torch.tensor([5, 4, 5, 3, 5, 4])
    entropy = torch.rand(b, t, generator=g, dtype=torch.float64) * 5
    turn_ids = torch.arange(t).unsqueeze(0).expand(b, t) // 10  # three turns of 10 tokens
    return {"log_prob": lp.float(), "rollout_log_prob": rlp.float(), "response_mask": mask, "versions": versions,
            "entropy": entropy, "turn_ids": turn_ids,
            "current_version": 5, "config": {"rollout_is": "token", "rollout_is_threshold": 2.0,
                                             "rollout_rs": "token_k1", "rollout_rs_threshold": "0.5_2.0"}}


def test_report_cli_writes_page_and_numbers(tmp_path):
    batch = _batch()
    path = tmp_path / "batch.pt"
    torch.save(batch, path)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-m", "rollout_corr_ext.report", str(path), "--worst", "3"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    png, js = tmp_path / "batch.png", tmp_path / "batch.json"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10000
    r = json.loads(js.read_text())
    assert "ratio:" in out.stdout and "worst sequence: row 4" in out.stdout

    lp, rlp, mask = batch["log_prob"].double(), batch["rollout_log_prob"].double(), batch["response_mask"]
    deciles = [[] for _ in range(10)]
    pbins = [[] for _ in range(10)]
    lags = {}
    ebins = [[] for _ in range(6)]
    turns = [[] for _ in range(3)]
    for i in range(lp.shape[0]):
        n = int(mask[i].sum())
        for j in range(n):
            d = abs(float(lp[i, j] - rlp[i, j]))
            deciles[min(j * 10 // n, 9)].append(d)
            pbins[min(int(float(lp[i, j].exp()) * 10), 9)].append(d)
            lags.setdefault(5 - int(batch["versions"][i]), []).append(d)
            ebins[sum(1 for e in (0.1, 0.5, 1.0, 2.0, 4.0) if float(batch["entropy"][i, j]) >= e)].append(d)
            turns[j // 10].append(d)
    assert len(r["by_turn"]) == 3
    for got, want in ((r["by_position_decile"], deciles), (r["by_probability_bin"], pbins),
                      (r["by_entropy_bin"], ebins), (r["by_turn"], turns)):
        for g_, w_ in zip(got, want):
            assert (g_ is None and not w_) or g_ == pytest.approx(sum(w_) / len(w_), rel=1e-9)
    assert [x for x in r["by_version_lag"]] == pytest.approx([sum(lags[k]) / len(lags[k]) for k in range(3)])
    assert r["worst_rows"][0]["row"] == 4 and len(r["worst_rows"]) == 3
    # row 4's mismatch is far outside the token_k1 bounds: the report names the criterion that cut it
    assert r["worst_rows"][0]["rejected_by"] == ["token_k1"]
    assert "entropy:" in out.stdout and "turn:" in out.stdout and "Jensen-Shannon" in out.stdout
    assert r["by_position_decile"][-1] > r["by_position_decile"][0]  # the growth is seen
    assert r["tokens"] == int(mask.sum())
    assert "rollout_corr/rollout_rs_masked_fraction" in r["metrics"]


def test_report_refuses_a_batch_without_its_tensors(tmp_path):
    from rollout_corr_ext.report import main

    path = tmp_path / "bad.pt"
    torch.save({"log_prob": torch.zeros(2, 3)}, path)
    with pytest.raises(ValueError, match="missing"):
        main([str(path)])


def test_report_over_steps_from_a_metrics_jsonl(tmp_path):
    """A metrics .jsonl (the demo's flat records, or verl-style {"step", "data"}): the page over steps, each
    setting's series and last values as written, and a verdict per setting."""
    path = tmp_path / "metrics.jsonl"
    lines = []
    for step in range(8):
        lines.append({"setting": "tis", "step": step, "rollout_corr/kl": 1e-4 * (step + 1),
                      "rollout_corr/rollout_is_p5": 0.9, "rollout_corr/rollout_is_p95": 1.1,
                      "rollout_corr/rollout_rs_masked_fraction": 0.01 * step})
        lines.append({"step": step, "data": {"setting": "drift", "rollout_corr/kl": 1e-3 * 2 ** step,
                                             "demo/token_ratio_p05": 0.7, "demo/token_ratio_p95": 1.4}})
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-m", "rollout_corr_ext.report", str(path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    png, js = tmp_path / "metrics.png", tmp_path / "metrics.json"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = json.loads(js.read_text())
    tis, drift = r["settings"]["tis"], r["settings"]["drift"]
    assert tis["steps"] == list(range(8)) and tis["series"]["kl"] == pytest.approx([1e-4 * (s + 1) for s in range(8)])
    assert tis["last"]["rejected"] == pytest.approx(0.07) and drift["last"]["p5"] == 0.7  # the demo's fallback key
    assert drift["last"]["rejected"] is None
    v = {line.split(" ")[0]: line for line in r["verdicts"]}
    assert "bf16-level noise" in v["tis"] and "inside" in v["tis"] and "above 5 %" in v["tis"]
    assert "above 1e-3" in v["drift"] and "OUTSIDE" in v["drift"] and "grows" in v["drift"]
    assert all(line in out.stdout for line in r["verdicts"])
