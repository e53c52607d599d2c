"""Vocab-parallel log-probs, entropy and cross entropy: the autograd function and its one collective.

Forward (docs/logprobs.md): one read of the local shard -> a shard record (a 64-byte header + 16-20 B per row) -> **one**
all-gather over ``tp_group`` (none at TP=1) -> merge. Every rank checks the gathered headers, so shards that do not
tile the vocab, disagree on rows or targets, or hold NaN/+inf logits give the same clear error on every rank.
Backward: no collective, one read and one write of the shard. Saved: the logits themselves (not a copy) plus
12 B per row.
"""

from __future__ import annotations

import math
import numbers
import operator
import sys
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import _layout as LY, ops

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_STATUS_MESSAGES = (
    (LY.STATUS_TARGET, "vocab_parallel_log_probs: target holds ids outside [0, vocab_size) that are not "
                              "ignore_index (run on CPU for the position)"),
    (LY.STATUS_NON_FINITE, "vocab_parallel_log_probs: logits hold NaN or +inf in a row whose target is not "
                                 "ignore_index (run on CPU for the position)"),
    (LY.STATUS_NO_FINITE_LOGIT, "vocab_parallel_log_probs: a row whose target is not ignore_index has no "
                                       "finite logit (all -inf): its softmax is undefined"),
    (LY.STATUS_LAYOUT, "vocab_parallel_log_probs: the tensor-parallel shards do not fit together (vocab "
                              "ranges overlap or leave gaps, or the ranks disagree on vocab_size, record format or "
                              "targets); check vocab_start / vocab_size, or pass check_group=True for a named error"),
)


# --------------------------------------------------------------------------------------------- argument checks


def as_int(name: str, value) -> int:
    """An integral argument (int, numpy integer, 0-dim integer tensor); bools and floats are refused."""
    if isinstance(value, bool) or isinstance(value, float):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None


def as_real(name: str, value) -> float:
    """A real-number argument (int, float, numpy scalar); bools, strings and tensors are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    try:
        return float(value)
    except OverflowError:  # an int past the float range: named here, not a bare OverflowError at the first use
        raise ValueError(f"{name} must be a finite real number, got an integer of {int(value).bit_length()} bits, "
                         f"past the float range") from None


def as_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def _positive_finite(name: str, value) -> float:
    v = as_real(name, value)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return v


def checked_inv_temperature(temperature, dtype: torch.dtype) -> float:
    """1 / temperature, checked against the type the kernels compute in for ``dtype`` inputs (fp64 for fp64, fp32
    otherwise): outside [tiny, max] of that type it would overflow to inf or flush to 0 there, so every row would
    fail (or be flat) for a reason that is not in the inputs.

    Under torch.compile the temperature may be a symbol (``dynamic=True``, or a value that changed between calls:
    torch 2.14 does not specialize floats), whose checks here would be guards (sympy takes symbols as finite, so
    ``t < inf`` always holds) or graph breaks (``math.isfinite``): traced, the same checks are an assert on a
    tensor of the value, made at run time (and the kernels' boundary checks 1 / temperature again,
    csrc/logprob_host.h)."""
    acc = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32)
    if torch.compiler.is_compiling():
        t = torch.scalar_tensor(temperature, dtype=torch.float64)
        inv = 1.0 / t
        torch._assert_async(torch.isfinite(t) & (t > 0) & (inv >= acc.tiny) & (inv <= acc.max),
                            f"temperature must be finite and > 0, and 1 / temperature in [{acc.tiny}, {acc.max}] "
                            f"for {dtype} inputs")
        # traced at 0 (torch gives a zero float its own symbol), 1 / 0 fails in tracing before the assert can run
        return 1.0 / (temperature if temperature != 0 else 1.0)
    temperature = _positive_finite("temperature", temperature)
    inv = 1.0 / temperature
    if not acc.tiny <= inv <= acc.max:
        raise ValueError(f"temperature={temperature!r} is out of range for {dtype} inputs: the kernels compute in "
                         f"{acc.dtype}, where 1 / temperature must lie in [{acc.tiny}, {acc.max}], i.e. temperature "
                         f"in [{1.0 / acc.max:.6g}, {1.0 / acc.tiny:.6g}]")
    return inv


# --------------------------------------------------------------------------------------------- groups


def group_size_rank(group) -> Tuple[int, int]:
    if group is None:
        return 1, 0
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("tp_group was given but torch.distributed is not initialized")
    return dist.get_world_size(group), dist.get_rank(group)


def megatron_tp_size() -> int:
    """The tensor-parallel size megatron-core was initialized with (1 when it is not imported or initialized)."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is None:
        return 1
    try:
        if ps.model_parallel_is_initialized():
            return int(ps.get_tensor_model_parallel_world_size())
    except Exception:  # noqa: BLE001 - a half-initialized megatron is "not initialized" here
        return 1
    return 1


def all_gather(tensor: torch.Tensor, group, world: int) -> torch.Tensor:
    """All-gather of equal-length 1-D tensors into ``[world, len]``.

    torch >= 2.12 names it ``all_gather_single`` (``all_gather_into_tensor`` is its deprecated alias).
    """
    out = tensor.new_empty((world, tensor.shape[0]))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out.view(-1), tensor.contiguous(), group=group)
    return out


def _check_group_headers(record: torch.Tensor, group, world: int, vocab_size: int) -> None:
    """The optional pre-check: all-gather the 64-byte headers alone (int64, the same size on every rank) and check
    them on the host, so that ranks with different row counts or record formats get a clear error instead of a
    collective whose sizes do not match. Every rank reaches the same verdict."""
    hl = LY.header_len(record.dtype)
    header = record[:hl].clone().view(torch.int64)  # a fresh 1-D copy: an int64 view needs an aligned offset
    headers = all_gather(header, group, world).cpu().tolist()
    why = LY.layout_error(headers, vocab_size)
    if why is not None:
        raise ValueError("vocab_parallel_log_probs: the tensor-parallel shards do not fit together: " + why)


def assert_status(status: torch.Tensor) -> None:
    """CUDA: the merge's status slots as asynchronous device asserts (no host sync)."""
    for slot, message in _STATUS_MESSAGES:
        torch._assert_async(status[slot] == 0, message)


# --------------------------------------------------------------------------------------------- autograd


LOGPROB_OPS = "vocab_parallel_log_probs / vocab_parallel_cross_entropy / linear_log_probs"


class _VocabParallelLogProbs(torch.autograd.Function):
    """(logits [N, V_local], target [N]) -> (logp, entropy, mean_logp), each [N]."""

    @staticmethod
    def forward(ctx, logits, target, tp_group, world, vocab_start, vocab_size, inv_temperature, ignore_index,
                with_sum_z, with_entropy, inplace_backward, check_group):
        record = ops.vocab_row_stats(logits, target, vocab_start, vocab_size, inv_temperature, ignore_index,
                                     with_sum_z, with_entropy)
        if world > 1:
            if check_group:
                _check_group_headers(record, tp_group, world, vocab_size)
            gathered = all_gather(record, tp_group, world)
        else:
            gathered = record.unsqueeze(0)
        logp, entropy, mean_logp, row_state, status = ops.merge_row_stats(gathered, target, ignore_index, vocab_size,
                                                                          inv_temperature, with_sum_z)
        if logits.device.type == "cuda":
            assert_status(status)
        ctx.save_for_backward(logits, target, row_state)
        ctx.args = (vocab_start, vocab_size, inv_temperature, ignore_index, inplace_backward)
        ctx.set_materialize_grads(False)
        if not with_sum_z:
            ctx.mark_non_differentiable(mean_logp)
        if not with_entropy:  # NaN, never returned to the caller
            ctx.mark_non_differentiable(entropy)
        return logp, entropy, mean_logp

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, grad_mean_logp):
        with torch.no_grad():
            grad = _VocabParallelLogProbs._first_order(ctx, grad_logp, grad_entropy, grad_mean_logp)
        if grad is None or not torch.is_grad_enabled():
            return (grad,) + (None,) * 11
        # create_graph=True: the gradient must not look differentiable-with-zero-second-order. Attach it to every
        # input that requires grad through a node whose backward raises, so that differentiating it again is a
        # clear error rather than a silently dropped term.
        anchors = [t for t in (ctx.saved_tensors[0], grad_logp, grad_entropy, grad_mean_logp)
                   if t is not None and t.requires_grad]
        if anchors:
            grad = ops.NoDoubleBackward.apply(grad, LOGPROB_OPS, *anchors)
        return (grad,) + (None,) * 11

    @staticmethod
    def _first_order(ctx, grad_logp, grad_entropy, grad_mean_logp):
        logits, target, row_state = ctx.saved_tensors
        vocab_start, vocab_size, inv_temperature, ignore_index, inplace_backward = ctx.args
        if grad_logp is None and grad_entropy is None and grad_mean_logp is None:
            return None
        if inplace_backward:
            ops.logprob_backward_(logits, grad_logp, grad_entropy, grad_mean_logp, target, row_state,
                                  vocab_start, vocab_size, inv_temperature, ignore_index)
            # The buffer now holds the gradient: bump its version so that autograd refuses any other node (or a
            # second backward of this one, retain_graph=True) that saved these logits.
            torch.autograd.graph.increment_version(logits)
            grad = logits
        else:
            grad = ops.logprob_backward(grad_logp, grad_entropy, grad_mean_logp, logits, target, row_state,
                                        vocab_start, vocab_size, inv_temperature, ignore_index)
        return grad


def check_target(target, x: torch.Tensor, x_name: str) -> None:
    """target: int64/int32 token ids of shape x.shape[:-1] on x's device."""
    if not isinstance(target, torch.Tensor) or target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target must be an int64 (or int32) tensor of token ids, got "
                        f"{getattr(target, 'dtype', type(target))}")
    if tuple(target.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"target must have shape {x_name}.shape[:-1] = {tuple(x.shape[:-1])}, "
                         f"got {tuple(target.shape)}")
    if target.device != x.device:
        raise ValueError(f"target is on {target.device} but {x_name} is on {x.device}; they must match")


def vocab_layout(vocab_start, vocab_size, rank: int, world: int, local_vocab: int) -> Tuple[int, int]:
    """(vocab_start, vocab_size) with megatron's even-shard defaults, range-checked."""
    vocab_start = rank * local_vocab if vocab_start is None else as_int("vocab_start", vocab_start)
    vocab_size = world * local_vocab if vocab_size is None else as_int("vocab_size", vocab_size)
    if vocab_start < 0:
        raise ValueError(f"vocab_start must be >= 0, got {vocab_start}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    return vocab_start, vocab_size


def check_single_shard(world: int, vocab_start: int, vocab_size: int, local_vocab: int, what: str,
                       local_name: str) -> None:
    if world == 1 and (vocab_start != 0 or vocab_size > local_vocab):
        raise ValueError(f"with a single shard (tp_group of size 1 or None) {what} must hold the whole vocab: "
                         f"vocab_start must be 0 (got {vocab_start}) and vocab_size <= {local_vocab} = "
                         f"{local_name} (got {vocab_size})")


def _vocab_parallel(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp_group,
    vocab_start,
    vocab_size,
    temperature,
    ignore_index,
    with_sum_z: bool,
    inplace_backward,
    check_group,
    with_entropy: bool = True,
    entry: str = "vocab_parallel_log_probs",
):
    if not isinstance(logits, torch.Tensor) or logits.dtype not in FLOAT_DTYPES:
        raise TypeError(f"logits must be a float16/bfloat16/float32/float64 tensor, got "
                        f"{getattr(logits, 'dtype', type(logits))}")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty last (vocab) dimension, got shape {tuple(logits.shape)}")
    check_target(target, logits, "logits")
    inv_temp = checked_inv_temperature(temperature, logits.dtype)
    ignore_index = as_int("ignore_index", ignore_index)
    inplace_backward = as_bool("inplace_backward", inplace_backward)
    if check_group is not None:
        check_group = as_bool("check_group", check_group)

    world, rank = group_size_rank(tp_group)
    local_vocab = logits.shape[-1]
    if tp_group is None and vocab_size is None and megatron_tp_size() > 1:
        raise ValueError(
            f"tp_group=None, but megatron-core is initialized with tensor-parallel size {megatron_tp_size()}: "
            f"these logits are probably one vocab shard. Pass tp_group (or use "
            f"rollout_corr_ext.megatron.{entry}, which defaults to megatron's group); for logits "
            f"that hold the whole vocab on this rank, pass vocab_size explicitly")
    vocab_start, vocab_size = vocab_layout(vocab_start, vocab_size, rank, world, local_vocab)
    if with_sum_z and vocab_size < 2:
        raise ValueError(f"label_smoothing > 0 needs vocab_size >= 2 (it spreads mass over the other tokens), got "
                         f"vocab_size={vocab_size}")
    check_single_shard(world, vocab_start, vocab_size, local_vocab, "the logits", "logits.shape[-1]")
    if inplace_backward and logits.requires_grad and logits.is_leaf:
        raise ValueError("inplace_backward=True would overwrite a leaf tensor's values with its gradient; it is for "
                         "logits that are an intermediate result (the output layer's output)")
    if check_group is None:
        check_group = logits.device.type == "cpu"

    lead = logits.shape[:-1]
    if logits.stride(-1) != 1:  # clone, not contiguous(): an empty view counts as contiguous whatever its strides
        logits = logits.clone(memory_format=torch.contiguous_format)
    logits2d = logits.reshape(-1, local_vocab)  # a view whenever the leading dims are flattenable
    if inplace_backward and logits2d.shape[0] > 1 and logits2d.stride(0) < local_vocab:
        raise ValueError("inplace_backward=True needs logits whose rows do not share memory (got an expanded or "
                         "stride-0 view); pass a materialized tensor or inplace_backward=False")
    target1d = target.reshape(-1).to(torch.int64).contiguous()
    logp, entropy, mean_logp = _VocabParallelLogProbs.apply(
        logits2d, target1d, tp_group, world, vocab_start, vocab_size, inv_temp, ignore_index, with_sum_z,
        with_entropy, inplace_backward, check_group)
    return logp.reshape(lead), entropy.reshape(lead), mean_logp.reshape(lead), vocab_size


class _SmoothedNll(torch.autograd.Function):
    """megatron-core's label-smoothed loss (1 - s) (-logp) - s mean_logp, linear in (logp, mean_logp).

    Every logit's log-prob enters with a coefficient <= 0 (the target's is -(1 - eps), each other's -s / V), so a
    -inf log-prob anywhere makes the loss +inf, which the formula itself cannot say when 1 - s <= 0 (0 * inf, or
    inf - inf). The value is therefore +inf wherever mean_logp is -inf; the gradient is the formula's (its
    coefficients), as before.
    """

    @staticmethod
    def forward(ctx, logp, mean_logp, smoothing: float):
        ctx.smoothing = smoothing
        loss = (1.0 - smoothing) * -logp - smoothing * mean_logp
        return torch.where(mean_logp == -math.inf, torch.full_like(loss, math.inf), loss)

    @staticmethod
    def backward(ctx, grad):
        s = ctx.smoothing
        return None if grad is None else -(1.0 - s) * grad, None if grad is None else -s * grad, None


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    target: torch.Tensor,
    tp_group=None,
    *,
    vocab_start: Optional[int] = None,
    vocab_size: Optional[int] = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    inplace_backward: bool = False,
    check_group: Optional[bool] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Log-probabilities of ``target`` under ``softmax(logits / temperature)`` with the vocab split over ``tp_group``.

    Args:
        logits: this rank's shard ``[..., V_local]`` (bf16/fp16/fp32/fp64), e.g. megatron's ``[s, b, V_local]``.
            ``-inf`` entries (top-k / top-p masks) are legal: probability 0, no entropy contribution, zero gradient.
        target: **global** token ids ``[...]`` (int64 or int32), the same on every rank of the group.
        tp_group: the tensor-parallel process group (None: the logits hold the whole vocab, no collective).
        vocab_start: global id of this shard's first column (default ``rank * V_local``; pass it with uneven shards).
        vocab_size: true vocab size; columns at or past it are padding and excluded (default ``world * V_local``).
        temperature: z = logits / temperature (finite, > 0).
        ignore_index: positions with this target give 0 and zero gradient (their logits are not inspected).
        return_entropy: also return the entropy of ``softmax(z)``.
        inplace_backward: write the gradient into the logits buffer (saves one ``[N, V_local]`` allocation). The
            buffer is overwritten during backward and its version counter bumped, so autograd raises if anything
            else saved these logits, or on a second backward (``retain_graph=True``). Refused for leaf tensors and
            for views whose rows share memory.
        check_group: all-gather the 64-byte record headers first and check them on the host (one more tiny
            collective), so that ranks with different row counts get a named error instead of a failed
            collective. Default: on for CPU tensors (gloo), off for CUDA tensors, where it would cost a host sync;
            the vocab layout, vocab_size and targets are always checked after the one all-gather.

    Returns:
        fp32 log-probs ``[...]`` (fp64 for fp64 logits), and the entropy when ``return_entropy``. A target at a
        ``-inf`` column gives ``-inf``. NaN / +inf logits, rows whose every logit is ``-inf``, out-of-range
        targets and mismatched shards raise (CPU: a message naming the row; CUDA: an asynchronous device assert).
    """
    return_entropy = as_bool("return_entropy", return_entropy)
    logp, entropy, _, _ = _vocab_parallel(logits, target, tp_group, vocab_start, vocab_size, temperature,
                                          ignore_index, False, inplace_backward, check_group, return_entropy)
    return (logp, entropy) if return_entropy else logp


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    tp_group=None,
    *,
    vocab_start: Optional[int] = None,
    vocab_size: Optional[int] = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    inplace_backward: bool = False,
    check_group: Optional[bool] = None,
) -> torch.Tensor:
    """Drop-in for megatron-core's ``tensor_parallel.vocab_parallel_cross_entropy``: returns -logp (fp32).

    Label smoothing follows megatron-core's definition (smoothing = eps * V / (V - 1),
    loss = (1 - smoothing) * nll - smoothing * mean_i logp_i) but over the **global** vocab and the globally
    summed logits, so it is also right under TP (megatron-core averages over the local shard only,
    Megatron-LM issue #737). Unlike megatron-core it never modifies ``vocab_parallel_logits``. With label smoothing,
    a ``-inf`` logit makes the loss ``+inf`` (the smoothed target puts mass on a zero-probability token).
    """
    label_smoothing = as_real("label_smoothing", label_smoothing)
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    with_sum_z = label_smoothing > 0
    logp, _, mean_logp, v = _vocab_parallel(vocab_parallel_logits, target, tp_group, vocab_start, vocab_size,
                                            temperature, ignore_index, with_sum_z, inplace_backward, check_group,
                                            with_entropy=False, entry="vocab_parallel_cross_entropy")
    if not with_sum_z:
        return -logp
    return _SmoothedNll.apply(logp, mean_logp, label_smoothing * v / (v - 1))


def empty_cpu_cache() -> int:
    """Give back the output blocks that the CPU kernels keep between steps; returns their size in bytes (0 if none).

    On CPU, the large outputs a training step frees and asks for again (the ``[N, V_local]`` gradient of the
    out-of-place log-prob backward, rollout correction's weights and mask) come from one-block caches: when such a
    tensor is freed, its memory is kept for the next request of about the same size, which then skips the page
    faults of fresh memory (csrc/cpu/reused_buffer.h). At most one block is kept per output. This frees them, like
    ``torch.cuda.empty_cache()``. ``ROLLOUT_CORR_CPU_CACHE=0`` turns the caches off. CUDA tensors come from PyTorch's
    caching allocator and are not affected.
    """
    return ops.cpu_cache_bytes(release=True)
