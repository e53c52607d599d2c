"""rollout_corr_ext: exact, tensor-parallel rollout correction for megatron-core RL training.

The compiled extension (``rollout_corr_ext._C``, CPU kernels and, when built with CUDA, CUDA kernels)
registers the ops ``torch.ops.rollout_corr.*``. Without a build the package still works on the pure-PyTorch
oracle in :mod:`rollout_corr_ext.fallback` (one warning says so); :func:`backend` tells which is active and
:func:`load_extension` JIT-compiles the same sources that ``setup.py`` builds.
"""

from __future__ import annotations

import importlib
import os
import warnings

from . import _env

__version__ = "0.1.0"

_BACKEND = "fallback"


def _activate(module_has_cuda: bool) -> None:
    global _BACKEND
    from . import ops

    ops.on_extension_loaded()
    import torch

    # "cuda" only when the CUDA kernels exist *and* a device can run them; CPU tensors use the CPU kernels.
    _BACKEND = "cuda" if module_has_cuda and torch.cuda.is_available() else "cpu"


def check_built_sources(module_file, csrc=None) -> None:
    """Refuse a compiled module built from other sources than csrc/ holds (setup.py records their hash beside it,
    ``<module file>.sources``): its op schemas or slot layouts may differ from the ones the Python side reads from
    csrc/, which fails far from the cause or, for a layout, gives wrong values. Nothing to compare without the
    record (a module built another way) or without csrc/."""
    from . import _build

    if not module_file:
        return
    record = module_file + _build.SOURCES_SUFFIX
    if not os.path.isfile(record):
        return
    with open(record) as f:
        built = f.read().strip()
    now = _build.source_hash(csrc)
    if now is not None and built != now:
        raise RuntimeError(f"rollout_corr_ext: the compiled extension {module_file} was built from other sources "
                           f"than {csrc or _build.CSRC} holds now (in a source checkout: sources updated without a "
                           f"rebuild): rebuild or reinstall the package (in a checkout `pip install "
                           f"--no-build-isolation -e .` or `python setup.py build_ext --inplace`), or set "
                           f"ROLLOUT_CORR_FORCE_FALLBACK=1 for the pure-PyTorch backend")


def _try_prebuilt() -> bool:
    if _env.flag("ROLLOUT_CORR_FORCE_FALLBACK"):
        return False
    import torch  # first: _C links against libtorch/libc10, which importing torch loads

    try:
        module = importlib.import_module(f"{__name__}._C")
    except ImportError:
        return False

    check_built_sources(getattr(module, "__file__", None))
    _activate(bool(torch.ops.rollout_corr.built_with_cuda()))
    return True


def load_extension(verbose: bool = False, with_cuda: bool | None = None, build_directory: str | None = None):
    """JIT-compile the extension from ``csrc/`` (same source list and flags as ``setup.py``) and activate it.

    Returns the backend name. A no-op when a compiled backend is already active.
    """
    if _BACKEND != "fallback":
        return _BACKEND
    import torch
    from torch.utils.cpp_extension import load

    from . import _build

    use_cuda = _build.want_cuda() if with_cuda is None else with_cuda
    kwargs = _build.extension_kwargs(use_cuda)
    if build_directory is None:
        build_directory = _env.path("ROLLOUT_CORR_BUILD_DIR")
    if build_directory:
        os.makedirs(build_directory, exist_ok=True)
    load(
        name="rollout_corr_ext_jit" + ("_cuda" if use_cuda else "_cpu"),
        sources=_build.abs_paths(kwargs["sources"]),
        extra_include_paths=kwargs["include_dirs"],
        extra_cflags=kwargs["extra_compile_args"]["cxx"],
        extra_cuda_cflags=kwargs["extra_compile_args"].get("nvcc", []),
        extra_ldflags=kwargs["extra_link_args"],
        with_cuda=use_cuda,
        is_python_module=False,
        build_directory=build_directory,
        verbose=verbose,
    )
    _activate(bool(torch.ops.rollout_corr.built_with_cuda()))
    return _BACKEND


def backend() -> str:
    """The active backend: ``"cuda"`` (CPU + CUDA kernels), ``"cpu"`` (CPU kernels) or ``"fallback"``."""
    return _BACKEND


if not _try_prebuilt():
    if _env.flag("ROLLOUT_CORR_JIT"):
        try:
            load_extension()
        except Exception as exc:  # a failed JIT build must not make the package unimportable
            warnings.warn(f"rollout_corr_ext: ROLLOUT_CORR_JIT=1 but the JIT build failed ({exc!r}); using the "
                          f"pure-PyTorch fallback backend", RuntimeWarning, stacklevel=2)
    elif not _env.flag("ROLLOUT_CORR_FORCE_FALLBACK"):
        warnings.warn(
            "rollout_corr_ext: the compiled extension is not built; using the pure-PyTorch fallback backend "
            "(build with `pip install --no-build-isolation -e .` or call rollout_corr_ext.load_extension()).",
            RuntimeWarning,
            stacklevel=2,
        )

from .logprobs import empty_cpu_cache, vocab_parallel_cross_entropy, vocab_parallel_log_probs  # noqa: E402
from .linear import linear_log_probs  # noqa: E402
from .config import RolloutCorrectionConfig  # noqa: E402
from .correction import (  # noqa: E402
    RolloutCorrectionResult,
    RolloutDiagnosticsResult,
    compute_offpolicy_metrics,
    compute_rollout_correction,
)
from .observability import MismatchDiagnostics, log_histograms  # noqa: E402
from .sampling import (  # noqa: E402
    KeptTokens,
    SampledLogProbs,
    SamplingParams,
    kept_linear_log_probs,
    kept_log_probs,
    sampled_linear_log_probs,
    sampled_log_probs,
)

__all__ = [
    "__version__",
    "backend",
    "load_extension",
    "vocab_parallel_log_probs",
    "vocab_parallel_cross_entropy",
    "empty_cpu_cache",
    "linear_log_probs",
    "SamplingParams",
    "KeptTokens",
    "kept_log_probs",
    "kept_linear_log_probs",
    "SampledLogProbs",
    "sampled_log_probs",
    "sampled_linear_log_probs",
    "RolloutCorrectionConfig",
    "RolloutCorrectionResult",
    "RolloutDiagnosticsResult",
    "MismatchDiagnostics",
    "log_histograms",
    "compute_rollout_correction",
    "compute_offpolicy_metrics",
    "LOSS_AGG_MODES",
    "PolicyLossConfig",
    "agg_loss",
    "compute_policy_loss",
    "compute_policy_loss_vanilla",
    "compute_policy_loss_reinforce",
    "compute_policy_loss_bypass",
    "compute_policy_loss_decoupled",
    "POLICY_LOSS_MODES",
    "off_policy_sequence_mask",
    "calculate_grpo_loss",
    "kl_penalty",
    "make_policy_loss_func",
]

from .losses import (  # noqa: E402
    LOSS_AGG_MODES,
    POLICY_LOSS_MODES,
    PolicyLossConfig,
    agg_loss,
    calculate_grpo_loss,
    compute_policy_loss,
    compute_policy_loss_bypass,
    compute_policy_loss_decoupled,
    compute_policy_loss_reinforce,
    compute_policy_loss_vanilla,
    kl_penalty,
    off_policy_sequence_mask,
)
from .megatron import make_policy_loss_func  # noqa: E402  (megatron-core itself is imported lazily)
