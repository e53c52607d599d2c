"""Every benchmark command the docs show runs, at a tiny size (issue: every documented command runs in CI): each
script and each of its modes (``--packed``, ``--dist``, ``--ignored``), and ``--help`` names every mode. Figures are
not checked here (timings are never asserted in tests); only that each run finishes and prints its table. One dtype
per run where a script loops over several (each case also measures its memory in a fresh process, seconds each). On a
terminal a tqdm bar runs over the long loops, and none with ``--no-progress`` or without tqdm."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RUNS = {
    "logprob": ["bench_logprob.py", "--tokens", "64", "--vocab", "256", "--dtypes", "fp32", "--tp", "1", "2",
                "--reps", "1"],
    "logprob_options": ["bench_logprob.py", "--tokens", "32", "--vocab", "128", "--dtypes", "bf16", "--tp", "1",
                        "--reps", "1", "--device", "cpu", "--peak-gbps", "100"],
    "rollout_corr": ["bench_rollout_corr.py", "--b", "4", "--t", "64", "--repeats", "1"],
    "rollout_corr_options": ["bench_rollout_corr.py", "--b", "4", "--t", "64", "--repeats", "1", "--threads", "1",
                             "--warm-cache", "--peak-gbps", "100", "--device", "cpu"],
    "rollout_corr_packed": ["bench_rollout_corr.py", "--packed", "--b", "4", "--t", "64", "--min-len", "8",
                            "--repeats", "1", "--threads", "1", "--warm-cache", "--device", "cpu"],
    "rollout_corr_dist": ["bench_rollout_corr.py", "--dist", "--b", "4", "--t", "64", "--repeats", "1"],
    "sampling": ["bench_sampling.py", "--n", "32", "--vocab", "256", "--repeats", "1", "--tp", "1", "2",
                 "--dtypes", "bf16", "--top-k", "8", "--top-p", "0.8", "--temperature", "0.7", "--device", "cpu"],
    "policy_losses": ["bench_policy_losses.py", "--b", "4", "--t", "64", "--repeats", "1"],
    "policy_losses_options": ["bench_policy_losses.py", "--b", "4", "--t", "64", "--repeats", "1", "--flush-mib", "0",
                              "--losses", "gpg", "kl_cov", "--no-progress"],
    "policy_losses_flush_probe": ["bench_policy_losses.py", "--b", "4", "--t", "64", "--repeats", "1",
                                  "--flush-probe", "1", "2"],
    "torch_masks": ["bench_torch_masks.py", "--b", "4", "--t", "64", "--repeats", "1"],
    "sampling_ties": ["bench_sampling.py", "--ties", "--n", "8", "--vocab", "256"],
    "verl_fused": ["bench_verl_fused.py", "--n", "64", "--hidden", "16", "--vocab", "300", "--repeats", "1",
                   "--dtypes", "bf16"],
    "kept_linear": ["bench_kept_linear.py", "--n", "64", "--hidden", "16", "--vocab", "300", "--kept", "8",
                    "--repeats", "1", "--dtypes", "fp32", "--device", "cpu"],
    "linear_logprob": ["bench_linear_logprob.py", "--hidden", "16", "--vocab", "300", "--n", "64", "--n-time", "96",
                       "--repeats", "1", "--ignored", "0", "0.5", "--dtypes", "bf16", "--device", "cpu"],
}


def _run(args, timeout=600):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", args[0]), *args[1:]], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("name", list(RUNS))
def test_benchmark_runs_at_a_tiny_size(name):
    out = _run(RUNS[name])
    assert out.returncode == 0, f"{name} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    assert "|---" in out.stdout, f"{name} printed no table:\n{out.stdout[-2000:]}"


def _run_on_a_terminal(args, env):
    """``_run``, with stdout and stderr on a pseudo-terminal (120 columns): (exit status, everything written)."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "benchmarks", args[0]), *args[1:]], cwd=ROOT,
                            env=env, stdin=subprocess.DEVNULL, stdout=secondary, stderr=secondary)
    os.close(secondary)
    out = b""
    try:
        while True:
            if select.select([primary], [], [], 1.0)[0]:
                try:
                    data = os.read(primary, 65536)
                except OSError:  # the child closed the terminal (Linux: EIO)
                    break
                if not data:
                    break
                out += data
            elif proc.poll() is not None:
                break
        return proc.wait(timeout=120), out.decode(errors="replace")
    finally:
        os.close(primary)


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_progress_bar_on_a_terminal(tmp_path):
    """A tqdm bar on a terminal (never on a pipe: the runs above print clean tables); none with --no-progress; and
    without tqdm installed the run goes on without a bar."""
    pytest.importorskip("tqdm")
    ties = ["bench_sampling.py", "--ties", "--n", "8", "--vocab", "256"]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    bar = re.compile(r"ties:\s+\d+%\|")
    rc, out = _run_on_a_terminal(ties, env)
    assert rc == 0 and "|---" in out and bar.search(out), out[-2000:]
    rc, out = _run_on_a_terminal(ties + ["--no-progress"], env)
    assert rc == 0 and "|---" in out and not bar.search(out), out[-2000:]
    (tmp_path / "tqdm.py").write_text("raise ImportError('tqdm is not installed here')\n")  # shadows the real one
    env["PYTHONPATH"] = os.pathsep.join([ROOT, str(tmp_path), os.environ.get("PYTHONPATH", "")])
    rc, out = _run_on_a_terminal(ties, env)
    assert rc == 0 and "|---" in out and not bar.search(out), out[-2000:]


def test_help_lists_every_mode_and_every_default():
    """``--help`` of every script names its modes and shows the default of every option that has one."""

    for script, modes in (("bench_rollout_corr.py", ("--packed", "--dist")),
                          ("bench_linear_logprob.py", ("--ignored", "--memory-only")),
                          ("bench_logprob.py", ("--tp",)), ("bench_sampling.py", ("--tp", "--ties"))):
        out = _run([script, "--help"])
        assert out.returncode == 0, out.stderr[-2000:]
        text = " ".join(out.stdout.split())
        for mode in modes:
            assert mode in text, (script, mode)
        section = out.stdout.split("options:", 1)[1]
        entries = re.split(r"\n(?=  -)", section)  # one help entry per option, continuation lines included
        options = [e for e in entries if e.lstrip().startswith("--") and not e.lstrip().startswith("--help")]
        assert options, script
        for entry in options:
            assert "default" in entry, (script, entry)
