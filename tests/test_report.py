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


def _bad(tmp_path, name, content, capsys):
    """The CLI on a bad input: exit status 2 and one line naming what is wrong, no traceback."""
    from rollout_corr_ext.report import main

    path = tmp_path / name
    if name.endswith(".pt"):
        torch.save(content, path)
    else:
        path.write_text(content)
    with pytest.raises(SystemExit) as exc:
        main([str(path), "--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m rollout_corr_ext.report: error: ") and err.count("\n") == 1, err
    return err


def test_report_refuses_bad_batches_with_one_line_naming_the_entry(tmp_path, capsys):
    g = torch.Generator().manual_seed(0)
    rlp = -torch.rand(4, 6, generator=g, dtype=torch.float64)
    base = dict(log_prob=rlp + 0.05, rollout_log_prob=rlp, response_mask=torch.ones(4, 6, dtype=torch.long))
    cases = [({"log_prob": torch.zeros(2, 3)}, "missing"),
             ([1, 2], "expected a dict of tensors"),
             (dict(base, log_prob=base["log_prob"].tolist()), "batch['log_prob'] must be a tensor"),
             (dict(base, log_prob=base["log_prob"].long()), "batch['log_prob'] must be a floating-point tensor"),
             (dict(base, response_mask=torch.zeros(4, 6)), "no response token"),
             (dict(base, versions=torch.tensor([3, 3, 3]), current_version=5), "versions must be per token"),
             (dict(base, versions=torch.tensor([3., 3, 3, 3]), current_version=5), "must be an integer tensor"),
             (dict(base, versions=torch.tensor([3, 3, 3, 3]), current_version="5"), "current_version'] must be an int"),
             (dict(base, config=[1]), "batch['config'] must be a dict"),
             (dict(base, turn_ids=torch.zeros(4, 5, dtype=torch.long)), "turn_ids must be per token")]
    for i, (content, words) in enumerate(cases):
        assert words in _bad(tmp_path, f"bad{i}.pt", content, capsys), words
    from rollout_corr_ext.report import main

    with pytest.raises(SystemExit):
        main([str(tmp_path / "gone.pt")])
    assert "No such file or directory" in capsys.readouterr().err
    assert "step must be a finite number" in _bad(tmp_path, "steps.jsonl", '{"step": [1], "rollout_corr/kl": 1}\n',
                                                  capsys)
    assert "step must be a finite number" in _bad(tmp_path, "nan.jsonl", '{"step": NaN, "rollout_corr/kl": 1}\n',
                                                  capsys)
    good = tmp_path / "good.pt"
    torch.save(base, good)
    (tmp_path / "cut.pt").write_bytes(good.read_bytes()[:100])  # a truncated file
    with pytest.raises(SystemExit):
        main([str(tmp_path / "cut.pt"), "--out", str(tmp_path / "cut")])
    assert "not a readable torch.save file" in capsys.readouterr().err
    # a text file (the weights-only unpickler's KeyError), random bytes, an empty file: one line, exit 2 (the demo /
    # report fuzz: the text file was a traceback)
    for name, data in (("text.pt", b"hello\n"), ("noise.pt", bytes(range(7, 250, 3))), ("empty.pt", b"")):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(SystemExit) as exc:
            main([str(tmp_path / name), "--out", str(tmp_path / "x")])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "not a readable torch.save file" in err and err.count("\n") == 1, err
    # an --out into a directory that does not exist: named before any work, not a traceback after it
    with pytest.raises(SystemExit) as exc:
        main([str(good), "--out", str(tmp_path / "no_such_dir" / "x")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "no directory" in err and "no_such_dir" in err and err.count("\n") == 1, err
    # without --out, a batch in a missing directory is the missing file it is (not an --out error: the review)
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path / "no_such_dir" / "batch.pt")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "No such file or directory" in err and "--out" not in err, err
    # a torch.save-d 0-dim integer current_version is read as the int it holds
    torch.save(dict(base, versions=torch.tensor([3, 3, 4, 5]), current_version=torch.tensor(5)), good)
    assert main([str(good), "--out", str(tmp_path / "good")]) == 0


def test_report_caps_its_lag_buckets_and_writes_strict_json(tmp_path):
    """A batch from a run's first version (lags of a million) fills one capped bucket instead of a million; a batch
    without mismatch reads flat (0 / 0 was "grows, xinf"); NaN metrics (a step without tokens) are no reading, and
    the JSON written is strict (null, never NaN)."""
    from rollout_corr_ext.report import MAX_LAG_BUCKETS, build_report, main

    g = torch.Generator().manual_seed(0)
    rlp = -torch.rand(4, 6, generator=g, dtype=torch.float64)
    batch = dict(log_prob=rlp + 0.01, rollout_log_prob=rlp, response_mask=torch.ones(4, 6, dtype=torch.long),
                 versions=torch.tensor([0, 0, 10 ** 6 - 1, 10 ** 6]), current_version=10 ** 6)
    r = build_report(batch)
    assert r["version_lag_labels"][-1] == f"{MAX_LAG_BUCKETS + 1}+" and len(r["by_version_lag"]) == MAX_LAG_BUCKETS + 2
    assert [x is not None for x in r["by_version_lag"]] == [True, True] + [False] * (MAX_LAG_BUCKETS - 1) + [True]
    flat = build_report(dict(batch, log_prob=rlp))
    assert any("flat along the response, 0 throughout" in v for v in flat["verdicts"]), flat["verdicts"]
    path = tmp_path / "nan.jsonl"
    path.write_text('{"step": 0, "rollout_corr/kl": NaN, "rollout_corr/rollout_is_p5": NaN}\n'
                    '{"step": 1, "rollout_corr/kl": 2e-4}\n')
    assert main([str(path), "--out", str(tmp_path / "nan")]) == 0
    text = (tmp_path / "nan.json").read_text()
    assert "NaN" not in text and json.loads(text)["settings"]["run"]["series"]["kl"] == [None, 2e-4]


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


def test_report_edges_of_its_own_arguments(tmp_path, capsys):
    """The versions fuzz: ``worst=0`` raised a raw KeyError (the diagnostics keep no rows); a torch.save-d 0-dim
    current_version was replaced in the caller's batch by an int; a log-ratio that is one value past 1 in magnitude
    got 41 equal edges (bars of width 0, nothing drawn); a step past float's range in a .jsonl was a raw
    OverflowError; ``--worst -1`` was blamed on ``diagnostics.top_k``."""
    from rollout_corr_ext.report import build_report, load_steps, main

    batch = _batch()
    batch["current_version"] = torch.tensor(5)
    keep = dict(batch)
    got = build_report(batch, worst=0)
    assert got["worst_rows"] == [] and batch.keys() == keep.keys()
    assert all(batch[k] is keep[k] for k in batch) and isinstance(batch["current_version"], torch.Tensor)
    assert len(build_report(batch, worst=2)["worst_rows"]) == 2
    with pytest.raises(ValueError, match=r"worst \(the number of worst sequences listed\) must be an int >= 0"):
        build_report(batch, worst=-1)
    for shift in (2.0, -2.0, 1e6):
        lp = torch.full((2, 3), -1.0, dtype=torch.float64)
        hist = build_report({"log_prob": lp, "rollout_log_prob": lp - shift,
                             "response_mask": torch.ones(2, 3)})["log_ratio_hist"]
        edges = hist["edges"]
        assert len(edges) == 41 and all(b > a for a, b in zip(edges, edges[1:])), edges
        assert edges[0] < shift < edges[-1] and sum(hist["counts"]) == 6
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": %d}\n' % 10 ** 400)
    with pytest.raises(ValueError, match=r"step must be a finite number, got an integer of 1329 bits"):
        load_steps(str(path))
    torch.save(_batch(), tmp_path / "b.pt")
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path / "b.pt"), "--out", str(tmp_path / "out"), "--worst", "-1"])
    assert exc.value.code == 2 and "worst" in capsys.readouterr().err
    assert main([str(tmp_path / "b.pt"), "--out", str(tmp_path / "out0"), "--worst", "0"]) in (0, None)
