"""Run the public entry points on every implementation of the ops: the compiled CPU kernels, the CUDA kernels (when
a GPU is present), the emulated CUDA kernels (the very device code, thread by thread on the CPU) and the pure-PyTorch
fallback. The layers above ``rollout_corr_ext.ops`` call its functions by module attribute, so swapping those for
the emulator's or the fallback's runs the whole pipeline (autograd, checks, collectives) on that implementation.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Dict, Iterator, List

import torch

import rollout_corr_ext
from rollout_corr_ext import fallback, logprobs, ops

#: The log-prob ops of rollout_corr_ext.ops and the emulator knobs each accepts.
LOGPROB_OPS: Dict[str, tuple] = {
    "vocab_row_stats": ("threads", "vec", "schedule", "max_blocks"),
    "merge_row_stats": ("threads", "schedule", "max_blocks"),
    "logprob_backward": ("threads", "vec", "schedule", "max_blocks"),
    "logprob_backward_": ("threads", "vec", "schedule", "max_blocks"),
}


#: The sampling-replay ops (CPU and CUDA kernels, and the fallback's torch versions): swapped with the log-prob ops
#: for the fallback and the emulated variants, so that a replay runs on one implementation throughout.
SAMPLING_OPS = ("row_topk", "floor_fill", "floor_zero_", "mass_histogram", "count_at_least", "row_candidates",
                "scatter_rows", "candidate_decide")


def _emulated_sampling_ops(emu, knobs) -> Dict[str, object]:
    """The emulated sampling-replay ops with the launch knobs they accept; fp64 logits take the torch version of
    row_candidates, as ``ops.row_candidates`` routes them."""
    kn = {k: v for k, v in knobs.items() if k in ("threads", "schedule", "max_blocks")}
    impl = {op: functools.partial(getattr(emu, op), **kn) for op in SAMPLING_OPS}

    def row_candidates(x, k, target_col, width, temperature, valid_cols):
        if x.dtype == torch.float64:
            return fallback.row_candidates(x, k, target_col, int(width), float(temperature), int(valid_cols))
        return emu.row_candidates(x, k, target_col, int(width), float(temperature), int(valid_cols), **kn)

    impl["row_candidates"] = row_candidates
    return impl


def available(include_emulated: bool = True) -> List[str]:
    """Backend names usable on this machine: ``cpu`` (compiled kernels), ``fallback``, ``emulated``, ``cuda``."""
    names = []
    if rollout_corr_ext.backend() != "fallback":
        names.append("cpu")
    names.append("fallback")
    if include_emulated and rollout_corr_ext.backend() != "fallback":
        names.append("emulated")
    if torch.cuda.is_available() and rollout_corr_ext.backend() == "cuda":
        names.append("cuda")
    return names


def skip_reason(name: str):
    """Why a backend cannot run here (None when it can)."""
    if name == "cuda" and not (torch.cuda.is_available() and rollout_corr_ext.backend() == "cuda"):
        return "needs a CUDA device and the extension built with its CUDA kernels"
    if name in ("cpu", "emulated") and rollout_corr_ext.backend() == "fallback":
        return "needs the compiled extension (ROLLOUT_CORR_FORCE_FALLBACK=1 is set)"
    return None


def _emulated_merge(emu_merge, *args, **kwargs):
    """The emulated CUDA merge reports failures in its status slots; the CUDA path turns those into asynchronous
    device asserts, which on CPU tensors raise at once with the same messages."""
    out = emu_merge(*args, **kwargs)
    logprobs.assert_status(out[4])
    return out


@contextlib.contextmanager
def _swapped_ops(impl: Dict[str, object]) -> Iterator[str]:
    """Replace ``rollout_corr_ext.ops`` functions by ``impl`` (name -> callable) within the block; yields "cpu"."""
    saved = {op: getattr(ops, op) for op in impl}
    try:
        for op, fn in impl.items():
            setattr(ops, op, fn)
        yield "cpu"
    finally:
        for op, fn in saved.items():
            setattr(ops, op, fn)


def _skip_unless_runnable(name: str) -> None:
    reason = skip_reason(name)
    if reason:
        import pytest

        pytest.skip(reason)


@contextlib.contextmanager
def logprob_backend(name: str, **knobs) -> Iterator[str]:
    """Within the block, ``rollout_corr_ext.ops``' log-prob and sampling-replay functions run on backend ``name``;
    yields the device the inputs must live on. ``knobs`` (threads, vec, schedule, max_blocks) tune the emulated
    launches."""
    _skip_unless_runnable(name)
    if name in ("cpu", "cuda"):
        yield name
        return
    if name == "fallback":
        impl = {op: getattr(fallback, op) for op in tuple(LOGPROB_OPS) + SAMPLING_OPS}
    elif name == "emulated":
        from rollout_corr_testing.cuda_emulator.loader import load_emulator

        load_emulator()
        emu = torch.ops.rollout_corr_emu
        impl = {op: functools.partial(getattr(emu, op), **{k: v for k, v in knobs.items() if k in accepted})
                for op, accepted in LOGPROB_OPS.items()}
        impl["merge_row_stats"] = functools.partial(_emulated_merge, impl["merge_row_stats"])
        impl.update(_emulated_sampling_ops(emu, knobs))
    else:
        raise ValueError(f"unknown backend {name!r}")
    with _swapped_ops(impl) as device:
        yield device


#: The rollout-correction ops of rollout_corr_ext.ops that have emulated CUDA kernels (rollout_check is host logic:
#: its CPU version runs under every backend but the fallback).
ROLLOUT_OPS = ("rollout_seq_stats", "rollout_token_pass")


@contextlib.contextmanager
def rollout_backend(name: str, **knobs) -> Iterator[str]:
    """Within the block, ``rollout_corr_ext.ops``' rollout-correction passes run on backend ``name`` (``cpu``,
    ``cuda``, ``emulated``, ``fallback`` = the pure-PyTorch ops); yields the device the inputs must live on.
    ``knobs`` (threads, schedule, max_blocks) tune the emulated launches."""
    _skip_unless_runnable(name)
    if name in ("cpu", "cuda"):
        yield name
        return
    if name == "fallback":
        impl = {"rollout_seq_stats": lambda lp, rlp, m, a, cu=None: fallback.rollout_seq_stats(lp, rlp, m, cu, *a),
                "rollout_token_pass": lambda lp, rlp, m, st, a, rows, cu=None: fallback.rollout_token_pass(
                    lp, rlp, m, cu, st, *a, rows),
                "rollout_check": fallback.rollout_check}
    elif name == "emulated":
        from rollout_corr_testing.cuda_emulator.loader import load_emulator

        load_emulator()
        emu = torch.ops.rollout_corr_emu
        impl = {"rollout_seq_stats": lambda lp, rlp, m, a, cu=None: emu.rollout_seq_stats(lp, rlp, m, cu, *a, **knobs),
                "rollout_token_pass": lambda lp, rlp, m, st, a, rows, cu=None: emu.rollout_token_pass(
                    lp, rlp, m, cu, st, *a, rows, **knobs)}
    else:
        raise ValueError(f"unknown backend {name!r}")
    with _swapped_ops(impl) as device:
        yield device


# ---------------------------------------------------------------------------------------------------------
# Every op-level test on every device (issue §1): cpu, the emulated CUDA kernels, cuda
# ---------------------------------------------------------------------------------------------------------

#: The device variants of an op-level test, in test-id order: ``cpu`` (CPU tensors on the active backend: the compiled
#: CPU kernels, or the pure-PyTorch fallback under ROLLOUT_CORR_FORCE_FALLBACK=1), ``emulated`` (the CUDA kernels
#: thread by thread on the CPU emulator) and ``cuda`` (the CUDA kernels on a GPU).
DEVICES = ("cpu", "emulated", "cuda")

#: Small emulated launches: 64 threads, the descending turnstile schedule, at most 3 blocks, so grid-stride loops and
#: block reductions run while emulation stays cheap (the knob names every emulated family accepts).
EMULATED_KNOBS = dict(threads=64, schedule=1, max_blocks=3)

#: The policy-loss ops of rollout_corr_ext.ops that have emulated CUDA kernels.
POLICY_LOSS_OPS = ("policy_loss_rows",)


def device_skip_reason(name: str):
    """Why the device variant ``name`` cannot run here (None when it can). ``cpu`` always runs (on the fallback when
    the extension is not loaded); ``emulated`` and ``cuda`` as :func:`skip_reason` says."""
    if name == "cpu":
        return None
    return skip_reason(name)


def device_params(*names: str, emulated_reason: str = None, cuda_reason: str = None) -> list:
    """``pytest.param`` per device variant (default :data:`DEVICES`), each marked skip with its reason where it
    cannot run, so a CPU-only machine reports the CUDA variants as skipped instead of leaving them out. CUDA
    variants carry the ``cuda`` marker (``pytest -m cuda`` selects them on a GPU machine). ``emulated_reason`` /
    ``cuda_reason``: that variant is left out of ``names`` on purpose (sizes beyond the thread-by-thread emulator; a
    check that is an asynchronous device assert on CUDA, tested in a subprocess elsewhere); it is then listed as
    skipped with that reason, on every machine."""
    import pytest

    names = names or DEVICES
    out = []
    for name in names:
        reason = device_skip_reason(name)
        marks = [pytest.mark.skip(reason=f"{name}: {reason}")] if reason else []
        if name == "cuda":
            marks.append(pytest.mark.cuda)
        out.append(pytest.param(name, marks=marks, id=name))
    for name, why in (("emulated", emulated_reason), ("cuda", cuda_reason)):
        if why and name not in names:
            marks = [pytest.mark.skip(reason=f"{name}: {why}")] + ([pytest.mark.cuda] if name == "cuda" else [])
            out.append(pytest.param(name, marks=marks, id=name))
    return out


def _first_order(impl):
    """``impl`` with ``ops.policy_loss_rows``' keyword ``first_order`` (through :func:`ops.first_order_only`)."""

    def rows(log_prob, *args, first_order=None, **kwargs):
        if first_order is not None:
            log_prob = ops.first_order_only(log_prob, first_order)
        return impl(log_prob, *args, **kwargs)

    return rows


def _emulated_policy_loss_rows(knobs, log_prob, old_log_prob, advantages, response_mask, weights, clip_low,
                               clip_high, clip_c, loss_kind, cu_seqlens=None, param_a=0.0, param_b=0.0,
                               with_loss_mat=True):
    """``ops.policy_loss_rows`` on the emulated kernels, with the compiled op's autograd formula (registered on the
    emulator's op by ``ops.register_policy_loss_autograd``)."""
    if weights is not None:
        weights = weights.detach()  # a constant of the loss, as in ops.policy_loss_rows
    return torch.ops.rollout_corr_emu.policy_loss_rows(
        log_prob, old_log_prob, advantages, response_mask, weights, float(clip_low), float(clip_high),
        float(clip_c), int(loss_kind), cu_seqlens, float(param_a), float(param_b), bool(with_loss_mat), **knobs)


def _emulated_policy_loss_backward(knobs, grad_rows_loss, log_prob, old_log_prob, advantages, response_mask,
                                   weights, clip_low, clip_high, clip_c, loss_kind, cu_seqlens=None, param_a=0.0,
                                   param_b=0.0):
    """``ops.policy_loss_backward`` (kl_cov's own autograd node calls it) on the emulated kernel."""
    return torch.ops.rollout_corr_emu.policy_loss_backward.default(
        None, grad_rows_loss, log_prob, old_log_prob, advantages, response_mask, weights, float(clip_low),
        float(clip_high), float(clip_c), int(loss_kind), cu_seqlens, float(param_a), float(param_b), **knobs)


@contextlib.contextmanager
def policy_loss_backend(name: str, **knobs) -> Iterator[str]:
    """Within the block, ``rollout_corr_ext.ops.policy_loss_rows`` / ``policy_loss`` / ``policy_loss_backward`` (and
    so every policy loss, ``calculate_grpo_loss`` and ``make_policy_loss_func``) run on backend ``name``; yields the
    device the inputs must live on. ``knobs`` (threads, schedule, max_blocks) tune the emulated launches."""
    _skip_unless_runnable(name)
    if name in ("cpu", "cuda"):
        yield name
        return
    if name == "fallback":
        # differentiable torch ops; the loss through autograd over them
        impl = {"policy_loss_rows": _first_order(fallback.policy_loss_rows), "policy_loss": ops.policy_loss_composed,
                "policy_loss_backward": ops.policy_loss_backward_composed}
    elif name == "emulated":
        from rollout_corr_testing.cuda_emulator.loader import load_emulator

        load_emulator()
        ops.register_policy_loss_autograd("rollout_corr_emu")
        emu = torch.ops.rollout_corr_emu
        impl = {"policy_loss_rows": _first_order(functools.partial(_emulated_policy_loss_rows, dict(knobs))),
                # the compiled ops' one-node loss, over the emulated kernels
                "policy_loss": functools.partial(ops.policy_loss_node,
                                                 functools.partial(emu.policy_loss_rows.default, **knobs),
                                                 functools.partial(emu.policy_loss_backward.default, **knobs)),
                "policy_loss_backward": functools.partial(_emulated_policy_loss_backward, dict(knobs))}
    else:
        raise ValueError(f"unknown backend {name!r}")
    with _swapped_ops(impl) as device:
        yield device


@contextlib.contextmanager
def ops_on(name: str, **knobs) -> Iterator[str]:
    """Every op family of ``rollout_corr_ext.ops`` (log-probs, rollout correction, policy loss) on the device variant
    ``name`` of :data:`DEVICES` within the block; yields the device the inputs must live on. ``cpu`` swaps nothing (the
    active backend runs); ``emulated`` uses :data:`EMULATED_KNOBS` unless ``knobs`` are given."""
    reason = device_skip_reason(name)
    if reason:
        import pytest

        pytest.skip(f"{name}: {reason}")
    if name == "cpu":
        yield "cpu"
        return
    if name == "emulated" and not knobs:
        knobs = dict(EMULATED_KNOBS)
    no_vec = {k: v for k, v in knobs.items() if k != "vec"}  # vec: the log-prob kernels' knob alone
    with logprob_backend(name, **knobs) as device, rollout_backend(name, **no_vec), \
            policy_loss_backend(name, **no_vec):
        yield device


# ---------------------------------------------------------------------------------------------------------
# CUDA: checks that are asynchronous device asserts
# ---------------------------------------------------------------------------------------------------------

#: What a device-side assert prints: the CUDA runtime's error (the message given to ``torch._assert_async`` is not
#: kept on CUDA) or the kernel's own assertion line.
DEVICE_ASSERT_MARKERS = ("device-side assert", "Assertion", "CUDA error")

_SUBPROCESS_PRELUDE = """
import os, sys, warnings
sys.path.insert(0, {root!r})
warnings.simplefilter("ignore")
import torch
import rollout_corr_ext as rc
from rollout_corr_ext import _env
if rc.backend() == "fallback" and not _env.flag("ROLLOUT_CORR_FORCE_FALLBACK"):
    rc.load_extension()
assert rc.backend() == "cuda", "the subprocess has no CUDA backend: " + rc.backend()
from rollout_corr_ext import ops
"""


def run_python(code: str, timeout: float = 600.0):
    """Run ``code`` (after a prelude importing torch, rollout_corr_ext as rc and its ops, on the CUDA backend) in a
    fresh interpreter; returns the CompletedProcess. A device-side assert poisons the CUDA context of the process
    that triggers it, so tests of asynchronous checks run the bad call here, not in the test session."""
    import os
    import subprocess
    import sys
    import textwrap

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    source = _SUBPROCESS_PRELUDE.format(root=root) + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=timeout,
                          cwd=root)


def assert_device_assert(code: str, what: str = "") -> None:
    """``code`` must end its process with a device-side assert: the process fails, the line after the bad call
    (``torch.cuda.synchronize()``, added here) is never passed, and the output names a device assert."""
    import textwrap

    proc = run_python(textwrap.dedent(code) + "\ntorch.cuda.synchronize()\nprint('NO DEVICE ASSERT')\n")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "NO DEVICE ASSERT" not in proc.stdout, (
        f"{what}: expected a device-side assert, but the process finished (exit {proc.returncode}):\n{out[-3000:]}")
    assert any(m in out for m in DEVICE_ASSERT_MARKERS), (
        f"{what}: the process failed, but not with a device-side assert (exit {proc.returncode}):\n{out[-3000:]}")
