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


def available(include_emulated: bool = True) -> List[str]:
    """Backend names usable on this machine: ``cpu`` (compiled kernels), ``reference``, ``emulated``, ``cuda``."""
    names = []
    if rollout_corr_ext.backend() != "reference":
        names.append("cpu")
    names.append("reference")
    if include_emulated and rollout_corr_ext.backend() != "reference":
        names.append("emulated")
    if torch.cuda.is_available() and rollout_corr_ext.backend() == "cuda":
        names.append("cuda")
    return names


def skip_reason(name: str):
    """Why a backend cannot run here (None when it can)."""
    if name == "cuda" and not (torch.cuda.is_available() and rollout_corr_ext.backend() == "cuda"):
        return "needs a CUDA device and the extension built with its CUDA kernels"
    if name in ("cpu", "emulated") and rollout_corr_ext.backend() == "reference":
        return "needs the compiled extension (ROLLOUT_CORR_FORCE_REFERENCE=1 is set)"
    return None


def _emulated_merge(emu_merge, *args, **kwargs):
    """The emulated CUDA merge reports failures in its status slots; the CUDA path turns those into asynchronous
    device asserts, which on CPU tensors raise at once with the same messages."""
    out = emu_merge(*args, **kwargs)
    logprobs._assert_status(out[4])
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
    """Within the block, ``rollout_corr_ext.ops``' log-prob functions run on backend ``name``; yields the device
    the inputs must live on. ``knobs`` (threads, vec, schedule, max_blocks) tune the emulated launches."""
    _skip_unless_runnable(name)
    if name in ("cpu", "cuda"):
        yield name
        return
    if name == "reference":
        impl = {op: getattr(fallback, op) for op in LOGPROB_OPS}
    elif name == "emulated":
        from rollout_corr_testing.cuda_emulator.loader import load_emulator

        load_emulator()
        emu = torch.ops.rollout_corr_emu
        impl = {op: functools.partial(getattr(emu, op), **{k: v for k, v in knobs.items() if k in accepted})
                for op, accepted in LOGPROB_OPS.items()}
        impl["merge_row_stats"] = functools.partial(_emulated_merge, impl["merge_row_stats"])
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
    ``cuda``, ``emulated``, ``reference`` = the pure-PyTorch fallback); yields the device the inputs must live on.
    ``knobs`` (threads, schedule, max_blocks) tune the emulated launches."""
    _skip_unless_runnable(name)
    if name in ("cpu", "cuda"):
        yield name
        return
    if name == "reference":
        impl = {"rollout_seq_stats": lambda lp, rlp, m, a: fallback.rollout_seq_stats(lp, rlp, m, *a),
                "rollout_token_pass": lambda lp, rlp, m, st, a, rows: fallback.rollout_token_pass(lp, rlp, m, st, *a,
                                                                                                   rows),
                "rollout_check": fallback.rollout_check}
    elif name == "emulated":
        from rollout_corr_testing.cuda_emulator.loader import load_emulator

        load_emulator()
        emu = torch.ops.rollout_corr_emu
        impl = {"rollout_seq_stats": lambda lp, rlp, m, a: emu.rollout_seq_stats(lp, rlp, m, *a, **knobs),
                "rollout_token_pass": lambda lp, rlp, m, st, a, rows: emu.rollout_token_pass(lp, rlp, m, st, *a, rows,
                                                                                             **knobs)}
    else:
        raise ValueError(f"unknown backend {name!r}")
    with _swapped_ops(impl) as device:
        yield device
