"""Smoke runs of the demo trainer (the README's main-job command) on both ranks: a few steps of every correction
setting under ``torchrun --nproc_per_node=2`` (gloo, TP=2), then the JSONL, the PNG, run.json and each setting's
report page (``report_SETTING.pt`` / ``.png`` / ``.json``) must be there and sane; every flag of the demo at a tiny
size (``EXERCISED`` says which test covers which, and a test checks that it names every flag ``--help`` lists);
``--help`` gives every option a help text and its default; and examples/demo_table.py turns a smoke run into the
docs' results table."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("megatron.core", reason="the demo is built on megatron-core's TP layers")
pytest.importorskip("matplotlib", reason="the demo writes a PNG with matplotlib (the 'demo' extra)")
pytest.importorskip("tqdm", reason="the demo shows a tqdm progress bar (the 'demo' extra)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = ["none", "token_tis", "seq_mis", "geo_rs", "bypass", "none:noreplay"]
STEPS = 4


# Which test exercises each flag of the demo (test_every_demo_flag_is_exercised checks this names them all).
EXERCISED = {
    "--steps": "all runs", "--prompts": "all runs", "--group": "all runs", "--stale": "all runs",
    "--settings": "all runs", "--out-dir": "all runs",
    "--packed": "test_demo_packed_gives_the_padded_curves",
    "--device": "test_demo_other_flags (cpu), test_demo_device_cuda (cuda)",
    "--tp": "test_demo_other_flags (TP=1: DP=2)", "--minibatches": "test_demo_other_flags",
    "--digits": "test_demo_other_flags", "--lr": "test_demo_other_flags",
    "--geo-rs-threshold": "test_demo_other_flags", "--seed": "test_demo_other_flags",
    "--no-progress": "test_demo_other_flags (the other runs show the progress bar)",
    "--no-report": "every run but the smoke run (test_demo_smoke_two_ranks checks its report pages)",
    "--top-p": "all runs (0.9 by default), test_demo_other_flags, test_demo_no_truncation_is_the_unreplayed_run",
    "--top-k": "test_demo_other_flags", "--temperature": "test_demo_other_flags",
    "--help": "test_demo_help_lists_every_option",
    "--model": "all runs (gpt, the default), test_demo_tiny_model",
}


def _load_demo():
    spec = importlib.util.spec_from_file_location("demo_trainer", os.path.join(ROOT, "examples", "demo_trainer.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run_demo(tmp_path, out, *extra, settings=SETTINGS, steps=STEPS, base=("--prompts=4", "--group=4", "--stale=1")):
    # --standalone: the rendezvous store binds port 0 and hands its port to the ranks, so no port is picked free first
    # and bound later (one so picked, then taken by another test's gloo connection, failed a CI run: EADDRINUSE).
    # --local-addr: the ranks meet on 127.0.0.1 whatever the host's name resolves to.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr=127.0.0.1",
           "--nproc_per_node=2", os.path.join(ROOT, "examples", "demo_trainer.py"),
           f"--steps={steps}", *base, f"--settings={','.join(settings)}", f"--out-dir={out}", *extra]
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
    padded = _run_demo(tmp_path, tmp_path / "padded", "--no-report", settings=settings, steps=3)
    packed = _run_demo(tmp_path, tmp_path / "packed", "--packed", "--no-report", settings=settings, steps=3)
    assert len(padded) == len(packed) == 3 * len(settings)
    for a, b in zip(padded, packed):
        assert a.keys() == b.keys()
        for k, v in a.items():
            if isinstance(v, float):
                assert b[k] == pytest.approx(v, rel=1e-5, abs=1e-7), (a["setting"], a["step"], k)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """The default settings, a few steps: shared by the smoke test and the demo_table test."""
    tmp = tmp_path_factory.mktemp("demo_smoke")
    out = tmp / "demo"
    return out, _run_demo(tmp, out)


def test_demo_smoke_two_ranks(smoke_run):
    out, records = smoke_run
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
    # Sampling replay (top-p 0.9 by default): at step 0 the sampler is the policy in bf16, so with replay the
    # mismatch is the bf16 rounding alone, while without it every ratio carries the row's kept mass S < 1.
    first = {r["setting"]: r for r in records if r["step"] == 0}
    assert abs(first["none"]["rollout_corr/kl"]) < 1e-3 < first["none:noreplay"]["rollout_corr/kl"]
    assert 0 < first["none"]["rollout_corr/sampling_kept_mass_mean"] < 1
    assert "rollout_corr/sampling_kept_mass_mean" not in first["none:noreplay"]
    assert first["none:noreplay"]["demo/token_ratio_p95"] < 1.0 <= first["none"]["demo/token_ratio_p95"] + 1e-3

    png = (out / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000

    info = json.loads((out / "run.json").read_text())  # where the run came from, for examples/demo_table.py
    assert info["command"].startswith("torchrun --nproc_per_node=2 examples/demo_trainer.py --steps=")
    assert info["args"]["steps"] == STEPS and info["commit"] and "cores" in info["machine"]
    assert info["rollout_corr_ext_backend"] in ("cpu", "cuda", "fallback") and info["seconds"] > 0


def test_demo_report_pages(smoke_run):
    """The mismatch report of each setting's last step (rollout_corr_ext.report), from rank 0's batch: the batch
    (loadable as ``python -m rollout_corr_ext.report`` loads it), the JSON with the report's keys, and the PNG."""
    import torch

    out, records = smoke_run
    last = {r["setting"]: r for r in records if r["step"] == STEPS - 1}
    compared = []
    for name in SETTINGS:
        prefix = out / ("report_" + name.replace(":", "_"))
        batch = torch.load(f"{prefix}.pt", map_location="cpu", weights_only=True)  # tensors and plain values only
        # the response tokens of --prompts=4 x --group=4 responses of 3 digits (TP=2: rank 0 holds the whole batch)
        assert batch["log_prob"].shape == batch["rollout_log_prob"].shape == batch["response_mask"].shape == (16, 3)
        mask = batch["response_mask"]
        assert mask.dtype == torch.bool and 0 < int(mask.sum()) <= mask.numel()
        assert torch.isfinite(batch["log_prob"][mask]).all() and torch.isfinite(batch["rollout_log_prob"]).all()
        page = json.loads(open(f"{prefix}.json").read())
        for key in ("tokens", "rows", "config", "metrics", "ratio_p5", "ratio_p95", "kl", "by_position_decile",
                    "by_probability_bin", "worst_rows", "verdicts"):
            assert key in page, (name, key, sorted(page))
        assert page["tokens"] == int(mask.sum()) and page["rows"] == 16
        assert page["config"] == batch["config"] and len(page["by_position_decile"]) == 10
        assert page["verdicts"][0].startswith("ratio: p5 ")
        assert batch["config"]["rollout_is"] == {"token_tis": "token", "seq_mis": "sequence"}.get(name)
        assert batch["config"]["bypass_mode"] == (name == "bypass")
        # The batch the loss corrected at the last step: where the loss saw the same tokens (no token outside a
        # replayed kept set) against the same pi_old (not bypass), its k1 KL is the one metrics.jsonl logged.
        if not batch["config"]["bypass_mode"] and int(mask.sum()) == mask.numel() and \
                not last[name].get("rollout_corr/sampling_out_of_support_fraction"):
            assert page["metrics"]["rollout_corr/kl"] == pytest.approx(last[name]["rollout_corr/kl"], rel=1e-4)
            compared.append(name)
        png = open(f"{prefix}.png", "rb").read()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert compared, "no setting's report could be compared with its metrics"


def test_demo_other_flags(tmp_path):
    """Every flag the other runs leave at its default, in one run: TP=1 on 2 ranks (so DP=2, each rank its own
    prompts), one mini-batch, 2 digits, another lr, seed and geo_rs band, no progress bar, --device cpu spelled out."""
    out = tmp_path / "flags"
    extra = ("--device=cpu", "--tp=1", "--minibatches=1", "--digits=2", "--lr=1e-3", "--geo-rs-threshold=0.01_100",
             "--seed=3", "--no-progress", "--top-k=6", "--top-p=0.95", "--temperature=0.8", "--no-report")
    records = _run_demo(tmp_path, out, *extra, settings=["geo_rs", "bypass"], steps=2,
                        base=("--prompts=2", "--group=2", "--stale=1"))
    assert [(r["step"], r["setting"]) for r in records] == [(0, "geo_rs"), (0, "bypass"), (1, "geo_rs"),
                                                            (1, "bypass")]
    args = json.loads((out / "run.json").read_text())["args"]
    assert (args["tp"], args["minibatches"], args["digits"], args["lr"], args["seed"], args["no_progress"]) == \
        (1, 1, 2, 1e-3, 3, True)
    assert (args["top_k"], args["top_p"], args["temperature"]) == (6, 0.95, 0.8)
    assert args["no_report"] and not list(out.glob("report_*"))  # --no-report: no report page
    assert all(0 < r["rollout_corr/sampling_kept_mass_mean"] < 1 for r in records)  # the replay ran
    for r in records:
        assert 0.0 <= r["reward"] <= 1.0
        # rewards are fractions of 2 digits averaged over 2 x 2 responses on each of the 2 DP ranks
        assert (r["reward"] * 16) == pytest.approx(round(r["reward"] * 16), abs=1e-5)
    # the band [0.01, 100] of the geometric-mean ratio keeps every sequence of a 1-step-stale sampler
    assert all(r["rollout_corr/rollout_rs_seq_masked_fraction"] == 0 for r in records if r["setting"] == "geo_rs")


def test_demo_tiny_model(tmp_path):
    """--model tiny: megatron's TP linears around attention written in the demo, the loss on the logits; replay
    at step 0 leaves the bf16 rounding alone, as with the default GPTModel."""
    records = _run_demo(tmp_path, tmp_path / "tiny", "--model=tiny", "--no-progress", "--no-report",
                        settings=["none", "none:noreplay"], steps=2)
    first = {r["setting"]: r for r in records if r["step"] == 0}
    assert abs(first["none"]["rollout_corr/kl"]) < 1e-3 < first["none:noreplay"]["rollout_corr/kl"]
    assert json.loads((tmp_path / "tiny" / "run.json").read_text())["args"]["model"] == "tiny"


def test_demo_no_truncation_is_the_unreplayed_run(tmp_path):
    """--top-p 1 (no truncation): replaying and not replaying are the same run, to the bit; bad sampling flags are
    refused with the flag named."""
    records = _run_demo(tmp_path, tmp_path / "p1", "--top-p=1", "--no-progress", "--no-report",
                        settings=["seq_mis", "seq_mis:noreplay"], steps=2)
    by = {}
    for r in records:
        by.setdefault(r["setting"], []).append({k: v for k, v in r.items() if k != "setting"})
    assert by["seq_mis"] == by["seq_mis:noreplay"]
    demo = _load_demo()
    for bad, match in ((["--top-p", "0"], "--top-p"), (["--temperature", "-1"], "--temperature"),
                       (["--settings", "none,bogus:noreplay"], "unknown settings"),
                       (["--settings", "none,none"], "twice")):
        with pytest.raises(SystemExit):
            demo.parse_args(bad)


def test_demo_device_cuda(tmp_path):
    """--device cuda: a tiny run on the GPU(s) where there are any, else the clear error before any set-up."""
    import torch

    if torch.cuda.is_available():
        n = min(2, torch.cuda.device_count())
        if n < 2:
            pytest.skip(reason="the demo's smoke runs use 2 ranks; --device cuda needs 2 GPUs here")
        records = _run_demo(tmp_path, tmp_path / "cuda", "--device=cuda", "--no-progress", "--no-report",
                            settings=["token_tis"], steps=2)
        assert len(records) == 2
        return
    demo = _load_demo()
    with pytest.raises(SystemExit, match="no CUDA device is visible"):
        demo.main(["--device", "cuda", "--steps", "1"])


def _help_blocks(text):
    """--help's option entries: {'--flag': its help text (wrapped lines joined)}."""
    blocks, cur = {}, None
    for line in text.splitlines():
        if re.match(r"^  -", line):
            head, _, rest = line.strip().partition("  ")
            cur = [o.split()[0] for o in head.split(", ")][-1]
            blocks[cur] = rest.strip()
        elif cur and line.startswith("    "):
            blocks[cur] = (blocks[cur] + " " + line.strip()).strip()
        else:
            cur = None
    return blocks


def test_demo_help_lists_every_option(monkeypatch, capsys):
    """--help names every option with a non-empty help text and its default (ArgumentDefaultsHelpFormatter)."""
    monkeypatch.setenv("COLUMNS", "200")
    demo = _load_demo()
    with pytest.raises(SystemExit) as exc:
        demo.parse_args(["--help"])
    assert exc.value.code == 0
    blocks = _help_blocks(capsys.readouterr().out)
    parser = demo.build_parser()
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(options) >= 15
    for action in options:
        flag = action.option_strings[-1]
        assert action.help and action.help.strip(), f"{flag} has no help text"
        assert flag in blocks, f"{flag} missing from --help"
        text = blocks[flag]
        assert text and not text.startswith("(default"), f"{flag}: empty help in --help: {text!r}"
        assert f"(default: {action.default})" in text, f"{flag}: --help does not show its default: {text!r}"


def test_every_demo_flag_is_exercised():
    """EXERCISED (which smoke test runs each flag) names exactly the flags the demo has."""
    parser = _load_demo().build_parser()
    flags = {a.option_strings[-1] for a in parser._actions if a.option_strings}
    assert flags == set(EXERCISED), (flags ^ set(EXERCISED))


def test_demo_table(smoke_run):
    """examples/demo_table.py on a smoke run: the header (command, commit, machine), one row per setting, the
    columns docs/megatron.md shows, and the narrative's details table."""
    out, records = smoke_run
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "demo_table.py"), str(out), "--details"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    first = text.splitlines()[0]
    assert first.startswith("Command: `torchrun --nproc_per_node=2 examples/demo_trainer.py")
    assert "commit `" in first and "cores" in first and "s wall" in first
    columns = "| setting | reward | exact match | steps to 0.5 / 0.8 | rollout_corr/kl | chi2_token | rejected |"
    assert columns in text
    with open(os.path.join(ROOT, "docs", "megatron.md")) as f:
        assert columns in f.read(), "docs/megatron.md's results table has other columns than demo_table.py prints"
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| setting")]
    assert [r.split("|")[1].strip() for r in rows] == SETTINGS * 2  # the results table, then the details table
    # the reward column is the mean over the last fifth of the steps (here the last step)
    last = {r["setting"]: r["reward"] for r in records if r["step"] == STEPS - 1}
    for row in rows[:len(SETTINGS)]:
        cells = [c.strip().strip("*") for c in row.split("|")[1:-1]]
        assert float(cells[1]) == pytest.approx(last[cells[0]], abs=5.0001e-4)  # 3 decimals, half to even
    # a metrics.jsonl path works too, and --command overrides the header's command
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "demo_table.py"),
                           str(out / "metrics.jsonl"), "--command", "bash scripts/demo.sh"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("Command: `bash scripts/demo.sh`"), proc.stderr


def test_demo_refuses_bad_sizes_by_flag(capsys):
    """Counts the demo cannot run with are refused at parse time, naming the flag (the demo fuzz: --group 0,
    --minibatches 0, --digits 0 / 16, --stale -1, --tp 0 failed deep in a step with a traceback, --steps -1 ran and
    printed NaN, --top-k -3 was silently off, a bad --geo-rs-threshold failed after the process group was up)."""
    demo = _load_demo()
    for bad, match in ((["--group", "0"], "--group must be >= 1"), (["--prompts", "0"], "--prompts must be >= 1"),
                       (["--minibatches", "0"], "--minibatches must be >= 1"),
                       (["--steps", "-1"], "--steps must be >= 1"), (["--digits", "0"], "--digits must be >= 1"),
                       (["--digits", "16"], r"--digits must be <= 15 \(prompt and response take 2 \* digits"),
                       (["--stale", "-1"], "--stale must be >= 0, got -1"), (["--tp", "0"], "--tp must be >= 1"),
                       (["--top-k", "-3"], "--top-k must be >= 0"), (["--lr", "nan"], "--lr must be finite"),
                       (["--prompts", "2", "--group", "2", "--minibatches", "5"], "more than the 4 responses"),
                       (["--geo-rs-threshold", "1.1_0.9"], r"--geo-rs-threshold '1.1_0.9'.*lower bound 1.1")):
        with pytest.raises(SystemExit) as exc:
            demo.parse_args(bad)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and re.search(match, err), (bad, err)
    assert demo.parse_args(["--digits", "15", "--stale", "0", "--top-k", "0", "--lr", "0"]).digits == 15
    # a geo_rs threshold is checked only when geo_rs runs
    assert demo.parse_args(["--geo-rs-threshold", "1.1_0.9", "--settings", "none"]).settings == "none"


def test_demo_grpo_advantages_are_verls():
    """The demo's GRPO advantage against verl's own compute_grpo_outcome_advantage, a group of one included (verl:
    mean 0, std 1; the demo's r.std() of one response was NaN, and the run died in the loss: the demo fuzz)."""
    import torch

    core = pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl's GRPO advantage is the oracle")
    import numpy as np

    demo = _load_demo()
    g = torch.Generator().manual_seed(0)
    for group in (1, 2, 4):
        rewards = torch.randint(0, 4, (3 * group,), generator=g).float() / 3  # ties, and equal groups
        rewards[:group] = 0.5  # a group of equal rewards: std 0
        mask = torch.ones(3 * group, 2)
        index = np.array([i // group for i in range(3 * group)], dtype=object)
        want, _ = core.compute_grpo_outcome_advantage(rewards[:, None] * torch.tensor([[0.0, 1.0]]), mask, index)
        got = demo.grpo_advantages(rewards, group)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want[:, 0], rtol=1e-6, atol=1e-6)


def test_demo_table_refuses_bad_input_by_name(tmp_path):
    """demo_table.py: a truncated last line (a run still being written) or a non-object line is one error naming
    file and line, --window / --tail below 1 are refused by name (the demo fuzz: tracebacks, and --tail -1 averaged
    rows[1:] silently)."""
    good = {"setting": "none", "step": 0, "reward": 0.5, "exact_match": 0.0, "rollout_corr/kl": 0.0,
            "rollout_corr/chi2_token": 0.0, "rollout_corr/seq_masked_fraction": 0.0}
    cut = tmp_path / "cut.jsonl"
    cut.write_text(json.dumps(good) + "\n" + json.dumps(good)[:20])
    lst = tmp_path / "list.jsonl"
    lst.write_text("[1, 2]\n")
    ok = tmp_path / "ok.jsonl"
    ok.write_text(json.dumps(good) + "\n")
    script = os.path.join(ROOT, "examples", "demo_table.py")
    for args, words in (([str(cut)], f"{cut}:2: not a JSON record"), ([str(lst)], f"{lst}:1: not a JSON object"),
                        ([str(ok), "--window", "0"], "--window must be >= 1"),
                        ([str(ok), "--tail", "-1"], "--tail must be >= 1")):
        proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, script, str(ok), "--window", "1", "--tail", "1"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and "| none |" in proc.stdout, proc.stderr
