"""Rollout correction: IS weights, RS + veto mask and every diagnostic metric in two passes (docs/rollout_correction.md).

Data flow on each rank (``[B, T]`` = this rank's rows, or this rank's slice of every row under context
parallelism)::

    pass 1  ops.rollout_seq_stats   -> per-sequence aggregates [B, K]
            seq_group: all_reduce SUM (sum columns) + MAX (max columns)        (only with context parallelism)
    pass 2  ops.rollout_token_pass  -> weights, mask, packed partials (SUM vector, MAX vector + histogram)
            dp_group:  all_reduce SUM + all_reduce MAX of the partials         (exactly one of each)
    finalize (the reduced partials -> metrics: torch ops, no host sync;        -> metrics, batch-norm factor
              on plain CPU tensors the same formulas on numpy fp64 scalars)

So every metric is the single-process value over the concatenated global batch. The formulas are verl 0.9.1's
(``verl/trainer/ppo/rollout_corr_helper.py``); the tests hold them to an independent oracle
(``rollout_corr_testing.rollout_oracle``) and to verl's own functions.
"""

from __future__ import annotations

import hashlib
import math
import struct
from typing import Dict, NamedTuple, Optional, Tuple, Union

import numpy as np
import torch
import torch.distributed as dist

from . import _layout as LY
from . import ops
from .config import RS_CRITERIA, RolloutCorrectionConfig
from .ops import RolloutOpArgs

__all__ = ["RolloutCorrectionResult", "compute_rollout_correction", "compute_offpolicy_metrics", "finalize_metrics",
           "op_args", "config_fingerprint", "OFFPOLICY_KEYS"]

PREFIX = "rollout_corr/"
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MASK_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                torch.bfloat16, torch.float32, torch.float64)
#: verl 0.9.1 ``compute_offpolicy_metrics`` keys (without the prefix).
OFFPOLICY_KEYS = ("training_ppl", "training_log_ppl", "kl", "k3_kl", "rollout_ppl", "rollout_log_ppl",
                  "log_ppl_diff", "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio",
                  "chi2_token", "chi2_seq")
PERCENTILES = (5, 25, 50, 75, 95)
#: The partial vectors travel over dp_group at a size independent of the config (room for every distinct RS
#: criterion a config can name), so ranks with different configs cannot issue mismatched collectives; the MAX
#: vector carries two more slots, +h and -h of this rank's config fingerprint h (both survive the MAX unchanged
#: iff every rank has the same h).
_WIRE_CRITS = len(RS_CRITERIA)
_WIRE_SUM, _WIRE_MAX_BODY = LY.partial_sizes(_WIRE_CRITS)
_WIRE_MAX = _WIRE_MAX_BODY + 2
#: Fingerprints are integers below 2^24: exact in fp32 and fp64, so the MAX compares them exactly.
_FINGERPRINT_BUCKETS = 1 << 24


class RolloutDiagnosticsResult(NamedTuple):
    """:func:`compute_rollout_correction` with ``diagnostics=``: the three fields of
    :class:`RolloutCorrectionResult` (``metrics`` with the diagnostics' metrics added) and ``diagnostics``, a
    :class:`~rollout_corr_ext.observability.DiagnosticsOutput` (per-row values, the worst rows, histograms)."""

    weights: Optional[torch.Tensor]
    response_mask: torch.Tensor
    metrics: Dict[str, torch.Tensor]
    diagnostics: "object"

    def as_floats(self) -> Dict[str, float]:
        """The metrics as Python floats, with one host sync for all of them."""
        return _as_floats(self.metrics)


class RolloutCorrectionResult(NamedTuple):
    """``weights``: ``[B, T]`` IS weights (detached, 0 at padding) or None; float32, or float64 when
    ``log_prob`` or ``rollout_log_prob`` is float64. ``response_mask``: the input mask with rejected tokens set to
    0, in the input's dtype; ``metrics``: ``rollout_corr/*`` 0-dim fp64 tensors."""

    weights: Optional[torch.Tensor]
    response_mask: torch.Tensor
    metrics: Dict[str, torch.Tensor]

    def as_floats(self) -> Dict[str, float]:
        """The metrics as Python floats, with one host sync for all of them."""
        return _as_floats(self.metrics)


def _as_floats(metrics: Dict[str, torch.Tensor]) -> Dict[str, float]:
    if not metrics:
        return {}
    tensors = list(metrics.values())
    if not all(v.dim() == 0 and v.dtype == torch.float64 for v in tensors):
        tensors = [v.reshape(()).to(torch.float64) for v in tensors]
    values = torch.stack(tensors).tolist()
    return dict(zip(metrics.keys(), values))


def op_args(config: RolloutCorrectionConfig, exclude_nonfinite: bool = False) -> RolloutOpArgs:
    """The typed arguments the two passes take (schema: csrc/ops.cpp; codes: ``_layout``)."""
    spec = config.is_spec
    v = config.rollout_token_veto_threshold
    crits = config.rs_criteria
    return RolloutOpArgs(
        is_level=LY.IS_LEVEL[spec.level if spec is not None else "none"],
        is_mask=spec is not None and spec.mode == "mask",
        # TIS clamps below at is_lower too: 0 (no-op on a weight) unless two-sided.
        is_lower=float(spec.lower) if spec is not None and spec.lower is not None else 0.0,
        is_upper=float(spec.upper) if spec is not None else 1.0,
        is_metric_lower=float(spec.metric_lower) if spec is not None else 1.0,
        veto_threshold=float(v) if v is not None else None,
        exclude_nonfinite=bool(exclude_nonfinite),
        rs_level=[LY.RS_LEVEL[c.level] for c in crits],
        rs_stat=[LY.RS_STAT[c.stat] for c in crits],
        rs_lower=[float(c.lower) for c in crits],
        rs_upper=[float(c.upper) for c in crits],
        rs_apply_lower=[bool(c.apply_lower) for c in crits],
    )


def config_fingerprint(config: RolloutCorrectionConfig, exclude_nonfinite: bool = False) -> int:
    """An integer in [0, 2^24) identifying what the op applies: the packed parameters (IS spec, RS criteria with
    their resolved bounds, veto, nonfinite mode) and the batch normalisation. Equal configs give equal values;
    distinct ones collide with probability 2^-24."""
    values = [len(op_args(config, exclude_nonfinite).rs_level)]  # the criteria count first: lists of any length
    for v in op_args(config, exclude_nonfinite):  # every configuration argument, in schema order
        values += list(v) if isinstance(v, list) else [-1.0 if v is None else v]
    values.append(bool(config.rollout_is_batch_normalize))
    blob = struct.pack(f"<{len(values)}d", *[float(x) for x in values])
    return int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "little") % _FINGERPRINT_BUCKETS


# ------------------------------------------------------------------------------------------------- finalize


class _TensorMath:
    """What the metric formulas need beyond arithmetic, on 0-dim / 1-D fp64 tensors on the partials' device: no host
    sync, CUDA-graph capturable, traceable by torch.compile."""

    where = staticmethod(torch.where)
    exp = staticmethod(torch.exp)
    sqrt = staticmethod(torch.sqrt)
    floor = staticmethod(torch.floor)
    minimum = staticmethod(torch.minimum)
    stack = staticmethod(torch.stack)

    @staticmethod
    def clamp_min(x, v):
        return x.clamp(min=v)

    @staticmethod
    def clamp_max(x, v):
        return x.clamp(max=v)

    @staticmethod
    def cumsum(x):
        return x.cumsum(0)

    @staticmethod
    def search_right(sorted_values, x):
        return torch.searchsorted(sorted_values, x, right=True)

    @staticmethod
    def to_f64(x):
        return x.to(torch.float64)


class _HostMath:
    """The same operations on numpy fp64 scalars and arrays, for partials in plain CPU tensors (read in place
    through ``Tensor.numpy()``): IEEE semantics like the tensor ops (x / 0 = inf, NaN propagates through the
    clamps; numpy's warnings are off), at about 1 % of the cost of ~100 dispatched 0-dim tensor ops."""

    @staticmethod
    def where(c, a, b):
        return a if c else b

    exp = staticmethod(np.exp)
    sqrt = staticmethod(np.sqrt)
    floor = staticmethod(np.floor)
    minimum = staticmethod(np.minimum)
    stack = staticmethod(np.stack)
    clamp_min = staticmethod(np.maximum)
    clamp_max = staticmethod(np.minimum)
    cumsum = staticmethod(np.cumsum)

    @staticmethod
    def search_right(sorted_values, x):
        return np.searchsorted(sorted_values, x, side="right")

    @staticmethod
    def to_f64(x):
        return np.asarray(x, dtype=np.float64)


def _host_arrays(sums: torch.Tensor, maxes: torch.Tensor):
    """numpy views of the partials when both are plain CPU tensors outside a torch.compile trace, else None."""
    if torch.compiler.is_compiling() or any(type(t) is not torch.Tensor or t.device.type != "cpu" or t.requires_grad
                                            for t in (sums, maxes)):
        return None
    try:
        return sums.numpy(), maxes.numpy()
    except (RuntimeError, TypeError):  # a tensor numpy cannot view (e.g. inside a functorch transform)
        return None


def _percentiles(hist, F) -> Dict[int, object]:
    """Percentiles (``torch.quantile``'s linear interpolation) read off the log-space histogram.

    Order statistic k lies in the first bin whose cumulative count exceeds k; it is read at the bin's geometric
    centre, so each estimate is within a factor exp(bin width / 2) = exp(20 / HIST_BINS) (< 0.49 %) of the
    exact order statistic, and so is the interpolation of two such estimates.
    """
    cum = F.cumsum(hist)
    total = cum[-1]
    width = (LY.HIST_HI - LY.HIST_LO) / LY.HIST_BINS
    last = F.clamp_min(total - 1, 0.0)
    # Built from Python scalars on the device: no host-to-device copy, so the op stays CUDA-graph capturable.
    pos = F.stack([last * (p / 100.0) for p in PERCENTILES])
    k0 = F.floor(pos)
    k1 = F.minimum(k0 + 1, last)
    frac = pos - k0
    i0 = F.clamp_max(F.search_right(cum, k0), LY.HIST_BINS - 1)
    i1 = F.clamp_max(F.search_right(cum, k1), LY.HIST_BINS - 1)
    c0 = F.exp(LY.HIST_LO + (F.to_f64(i0) + 0.5) * width)
    c1 = F.exp(LY.HIST_LO + (F.to_f64(i1) + 0.5) * width)
    est = c0 * (1 - frac) + c1 * frac
    return {p: est[i] for i, p in enumerate(PERCENTILES)}


#: A variance formed from fp64 sums as E[x^2] - E[x]^2 that is below this fraction of E[x^2] is the formula's
#: rounding, not a spread it can resolve (a relative spread under about 1e-7): it is 0. Otherwise values that are all
#: equal (every weight at the cap, every statistic clamped) gave a std of rounding noise that moved with the order
#: the partials were summed in (one process, CP ranks, a GPU grid: 0, 2^-28, 1.2e-10 for the same data).
VAR_ROUNDING = 64 * 2.0 ** -52


def _resolved(var, e2, F):
    """``var`` (E[x^2] - E[x]^2 of values whose E[x^2] is ``e2``), 0 at or below its rounding (and when negative);
    NaN and inf stay as they are."""
    return F.where(var < VAR_ROUNDING * e2, 0.0 * var, var)


def _std_from_sums(s, s2, n, F):
    """Unbiased std (``torch.std``) of n values from their sum and sum of squares (fp64)."""
    var = (s2 - s * s / F.clamp_min(n, 1.0)) / F.clamp_min(n - 1, 1.0)
    return F.where(n > 1, F.sqrt(F.clamp_min(_resolved(var, s2 / F.clamp_min(n - 1, 1.0), F), 0.0)), 0.0 * n)


class _Slots:
    """Named access to the reduced partial vectors: ``P.s.tokens``, ``P.m.is_weight``, ``P.crit(i)[0].stat``.
    Tensor blocks are split into 0-dim views by one ``unbind`` (not one indexing op per slot); numpy blocks are
    indexed (fp64 scalars)."""

    class _View:
        def __init__(self, block, index: Dict[str, int]):
            self._values = block.unbind() if isinstance(block, torch.Tensor) else block
            self._index = index

        def __getattr__(self, name: str):
            return self._values[self._index[name]]

    def __init__(self, sums, maxes):
        self.sums, self.maxes = sums, maxes
        self.s = _Slots._View(sums[:LY.SUM_HIST], LY.SUM)
        self.m = _Slots._View(maxes[:LY.MAX_CRIT_BASE], LY.MAX)
        self.hist = sums[LY.SUM_HIST:LY.SUM_CRIT_BASE]

    def crit(self, i: int):
        """The SUM and MAX slot blocks of RS criterion ``i``."""
        ns, nm = len(LY.CRIT_SUM), len(LY.CRIT_MAX)
        s0, m0 = LY.SUM_CRIT_BASE + i * ns, LY.MAX_CRIT_BASE + i * nm
        return (_Slots._View(self.sums[s0:s0 + ns], LY.CRIT_SUM), _Slots._View(self.maxes[m0:m0 + nm], LY.CRIT_MAX))


def finalize_metrics(
    sums: torch.Tensor, maxes: torch.Tensor, config: RolloutCorrectionConfig, exclude_nonfinite: bool = False,
    count_keeps_eps: bool = False,
) -> Dict[str, torch.Tensor]:
    """Turn the (globally reduced) partials into the ``rollout_corr/*`` metric dict (0-dim fp64 tensors on the
    partials' device).

    Each metric reads the slots of ``csrc/include/rollout_correction_layout.def`` by name (formulas: verl 0.9.1
    ``compute_is_metrics`` / ``compute_rs_metrics`` / ``compute_offpolicy_metrics``). The formulas run once, on
    torch ops (no host sync), or, for plain CPU tensors, on numpy fp64 scalars read in place, with the values
    returned as 0-dim views of one new tensor. ``count_keeps_eps``: verl's count of the response mask keeps its
    + 1e-8 (an fp64 mask, or an int / bool one under an fp64 default dtype: ``_layout.count_keeps_eps``); any other
    loses it to fp32 rounding in verl."""
    host = _host_arrays(sums, maxes)
    if host is None:
        return _metric_formulas(sums, maxes, config, exclude_nonfinite, _TensorMath, count_keeps_eps)
    with np.errstate(all="ignore"):
        met = _metric_formulas(*host, config, exclude_nonfinite, _HostMath, count_keeps_eps)
    values = torch.from_numpy(np.array(list(met.values()), dtype=np.float64)).unbind()
    return dict(zip(met.keys(), values))


def _metric_formulas(sums, maxes, config: RolloutCorrectionConfig, exclude_nonfinite: bool, F,
                     count_keeps_eps: bool = False) -> Dict[str, object]:
    """The metric formulas over the partials, with F (_TensorMath or _HostMath) for what is not arithmetic."""
    P = _Slots(sums, maxes)
    S, M = P.s, P.m
    met: Dict[str, object] = {}
    n = S.tokens
    # verl's masked_mean: sum / (count + 1e-8), the count in the mask's dtype (below); 0 / eps = 0 without tokens
    ne = n + LY.EPS if count_keeps_eps else F.clamp_min(n, LY.EPS)
    n1 = F.clamp_min(n, 1.0)
    rows = S.rows
    sv = S.valid_rows
    zero = 0.0 * n

    # verl's masked_mean is sum / (count + 1e-8) with the count in the mask's dtype: a bool / int mask's count
    # (int64 + 1e-8 -> fp32) and an fp32 mask's lose the 1e-8 to rounding (count >= 1), an fp64 mask's keeps it. It
    # changes a mean by 1e-8 / n relative, but a std from E[x^2] - E[x]^2 by up to |x| sqrt(1e-8 / n) (n equal values
    # x: 0 against that); every mean here (the kernels' row means too: Config::count_eps) takes verl's denominator
    std_den = ne if count_keeps_eps else n1

    def std_of_sums(s, s2):  # verl: sqrt(clamp(E[x^2] - E[x]^2, 0)) over valid tokens when more than one, from sum x
        # and sum x^2 (fp64)
        e2 = s2 / std_den
        return F.where(n > 1, F.sqrt(F.clamp_min(_resolved(e2 - (s / std_den) ** 2, e2, F), 0.0)), zero)

    def masked_std(Sc):  # the kernels sum each x's deviation from its row's centre c_b (no fp32 cancellation); sum x
        # and sum x^2 are rebuilt here in fp64, where the difference is harmless
        return std_of_sums(Sc.clamped_dev + Sc.centre, Sc.clamped_dev_sq + 2.0 * Sc.centre_dev + Sc.centre_sq)

    spec = config.is_spec
    if spec is not None:
        if spec.level == "token":
            w_sum = S.is_weight
            # sum wc and sum wc^2 from the deviations about each row's own mean weight (exact in fp64 up to rounding;
            # centring at one fixed value would lose sum wc^2 to cancellation when the weights are far from it)
            wc_sum = S.is_wc_dev + S.is_wc_centre
            wc_sq = S.is_wc_dev_sq + 2.0 * S.is_wc_centre_dev + S.is_wc_centre_sq
            met["rollout_is_mean"] = w_sum / ne
            met["rollout_is_ratio_fraction_high"] = S.is_high / ne
            met["rollout_is_ratio_fraction_low"] = S.is_low / ne
            met["rollout_is_max"] = M.is_weight
            met["rollout_is_min"] = -M.neg_is_weight
            oob = S.is_out_of_band
        else:
            w_sum, wc_sum, wc_sq = S.seq_is_weight, S.seq_is_wc, S.seq_is_wc_sq
            met["rollout_is_max"] = F.exp(F.clamp_max(M.is_log_weight, LY.SAFETY_BOUND))
            met["rollout_is_min"] = F.exp(-M.neg_is_log_weight)
            met["rollout_is_mean"] = w_sum / ne
            met["rollout_is_ratio_fraction_high"] = S.seq_is_high / rows
            met["rollout_is_ratio_fraction_low"] = S.seq_is_low / rows
            oob = S.seq_is_out_of_band
        met["rollout_is_std"] = std_of_sums(wc_sum, wc_sq)
        # every clamped weight 0 (IcePop dropping the whole batch): no sample counts, 0 (the formula gives eps^2 / 0)
        met["rollout_is_eff_sample_size"] = F.where(wc_sq > 0, ne * (wc_sum / ne + LY.EPS) ** 2 / wc_sq, zero)
        met["rollout_is_seq_mean"] = S.is_seq_mean / rows
        met["rollout_is_seq_std"] = _std_from_sums(S.is_seq_mean, S.is_seq_mean_sq, rows, F)
        met["rollout_is_seq_max"] = M.is_seq_mean
        met["rollout_is_seq_min"] = -M.neg_is_seq_mean
        met["rollout_is_seq_max_deviation"] = M.is_seq_deviation
        met["rollout_is_seq_fraction_high"] = S.is_seq_high / rows
        met["rollout_is_seq_fraction_low"] = S.is_seq_low / rows
        if spec.mode == "mask":
            met["rollout_is_oob_ratio"] = oob / ne
        for p, value in _percentiles(P.hist, F).items():
            met[f"rollout_is_p{p}"] = value
        if config.rollout_is_batch_normalize:
            mean = w_sum / ne if spec.level == "token" else S.is_seq_mean / F.clamp_min(sv, LY.EPS)
            met["rollout_is_batch_norm_factor"] = F.where(mean > 1e-8, mean, zero + 1.0)

    crits = config.rs_criteria
    for i, crit in enumerate(crits):
        Sc, Mc = P.crit(i)
        p = f"rollout_rs_{crit.name}"
        svc = F.clamp_min(sv, 1.0)
        met[f"{p}_mean"] = Sc.stat / ne
        met[f"{p}_max"] = Mc.stat
        met[f"{p}_min"] = -Mc.neg_stat
        denom = ne if crit.level == "token" else svc
        met[f"{p}_fraction_high"] = Sc.high / denom
        met[f"{p}_fraction_low"] = Sc.low / denom if crit.apply_lower else zero
        met[f"{p}_std"] = masked_std(Sc)
        met[f"{p}_seq_mean"] = Sc.seq / svc
        met[f"{p}_seq_std"] = _std_from_sums(Sc.seq, Sc.seq_sq, sv, F)
        met[f"{p}_seq_max"] = Mc.seq
        met[f"{p}_seq_min"] = -Mc.neg_seq
        met[f"{p}_seq_max_deviation"] = Mc.seq_deviation
        met[f"{p}_seq_fraction_high"] = Sc.seq_high / svc
        if crit.apply_lower:
            met[f"{p}_seq_fraction_low"] = Sc.seq_low / svc
        met[f"{p}_masked_fraction"] = Sc.rejected_tokens / ne
        met[f"{p}_seq_masked_fraction"] = Sc.rejected_rows / svc
    if crits:
        met["rollout_rs_masked_fraction"] = S.rs_rejected_tokens / ne
        met["rollout_rs_seq_masked_fraction"] = S.rs_rejected_rows / rows

    met["rollout_is_veto_fraction"] = S.veto_rows / rows
    met["rollout_is_catastrophic_token_fraction"] = S.catastrophic / ne
    met["masked_fraction"] = S.final_rejected_tokens / ne
    met["seq_masked_fraction"] = S.final_rejected_rows / F.clamp_min(sv, 1.0)
    if exclude_nonfinite:
        bad = S.nonfinite
        met["nonfinite_token_fraction"] = bad / (n + bad + LY.EPS)

    met["training_ppl"] = S.training_ppl / rows
    met["training_log_ppl"] = S.training_log_ppl / rows
    met["kl"] = -S.log_ratio / ne
    met["k3_kl"] = S.k3_raw / ne
    met["rollout_ppl"] = S.rollout_ppl / rows
    met["rollout_log_ppl"] = S.rollout_log_ppl / rows
    met["log_ppl_diff"] = S.log_ppl_diff / rows
    met["log_ppl_abs_diff"] = S.log_ppl_abs_diff / rows
    met["log_ppl_diff_max"] = M.log_ppl_diff
    met["log_ppl_diff_min"] = -M.neg_log_ppl_diff
    met["ppl_ratio"] = S.ppl_ratio / rows
    met["chi2_token"] = S.rho_sq / ne - 1.0
    met["chi2_seq"] = S.chi2_seq / rows - 1.0
    return {PREFIX + k: v for k, v in met.items()}


# ------------------------------------------------------------------------------------------------- the op


def _world(group, name: str) -> Tuple[int, int]:
    if group is None:
        return 1, 0
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{name} was given but torch.distributed is not initialized")
    return dist.get_world_size(group), dist.get_rank(group)


def check_correction_inputs(log_prob, rollout_log_prob, response_mask, config, nonfinite,
                            cu_seqlens=None) -> RolloutCorrectionConfig:
    """:func:`compute_rollout_correction`'s checks of its inputs (types, shapes, devices, ``nonfinite``); returns the
    config as a :class:`RolloutCorrectionConfig`."""
    for name, t in (("log_prob", log_prob), ("rollout_log_prob", rollout_log_prob)):
        if not isinstance(t, torch.Tensor) or t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be a float16/bfloat16/float32/float64 tensor, got "
                            f"{getattr(t, 'dtype', type(t))}")
    if not isinstance(response_mask, torch.Tensor) or response_mask.dtype not in _MASK_DTYPES:
        raise TypeError(f"response_mask must be a bool, integer or float tensor, got "
                        f"{getattr(response_mask, 'dtype', type(response_mask))}")
    if cu_seqlens is None:
        if log_prob.dim() != 2:
            raise ValueError(f"log_prob must be 2-D [batch, response_length], got shape {tuple(log_prob.shape)} "
                             f"(a packed token stream needs cu_seqlens)")
    else:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cu_seqlens must be an int32 or int64 tensor, got "
                            f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens))}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            raise ValueError(f"cu_seqlens must be 1-D [num_sequences + 1], got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.device != log_prob.device:
            raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but log_prob is on {log_prob.device}")
        if log_prob.dim() != 1 and not (log_prob.dim() == 2 and 1 in tuple(log_prob.shape)):
            raise ValueError(f"with cu_seqlens, log_prob must be the packed token stream [T] (or megatron's [1, T] / "
                             f"[T, 1]), got shape {tuple(log_prob.shape)}")
    if rollout_log_prob.shape != log_prob.shape:
        raise ValueError(f"rollout_log_prob shape {tuple(rollout_log_prob.shape)} does not match log_prob shape "
                         f"{tuple(log_prob.shape)}")
    if response_mask.shape != log_prob.shape:
        raise ValueError(f"response_mask shape {tuple(response_mask.shape)} does not match log_prob shape "
                         f"{tuple(log_prob.shape)}")
    for name, t in (("rollout_log_prob", rollout_log_prob), ("response_mask", response_mask)):
        if t.device != log_prob.device:
            raise ValueError(f"{name} is on {t.device} but log_prob is on {log_prob.device}; they must match")
    if nonfinite not in ("error", "exclude"):
        raise ValueError(f"nonfinite must be 'error' or 'exclude', got {nonfinite!r}")
    if isinstance(config, RolloutCorrectionConfig):
        return config
    if isinstance(config, dict) or hasattr(config, "keys"):
        return RolloutCorrectionConfig.from_dict(config)
    raise TypeError(f"config must be a RolloutCorrectionConfig or a dict, got {type(config)}")


def _check_seq_rows(b: int, device: torch.device, seq_group) -> None:
    """Context parallelism reduces per-row aggregates, so every rank of seq_group must hold the same rows. A
    mismatch would be a collective of different sizes (a gloo abort, an NCCL hang): compare the row counts first
    with one tiny MAX all-reduce of (B, -B) and raise the same clear error on every rank. Costs one 16-byte
    collective and, on CUDA, one host sync, only when seq_group has more than one rank."""
    probe = torch.tensor([b, -b], dtype=torch.int64).to(device)
    dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=seq_group)
    hi, neg_lo = probe.tolist()
    if hi != b or -neg_lo != b:
        raise ValueError(f"seq_group (context parallelism): the ranks hold different numbers of rows (between "
                         f"{-neg_lo} and {hi}; this rank {b}); every context-parallel rank must pass the same "
                         f"sequences, each its own slice of the response_length dimension")


def _reduce_partials(sums: torch.Tensor, maxes: torch.Tensor, fingerprint: int, group, extra=None):
    """SUM / MAX all-reduce of the partials over ``group`` at the fixed wire size, with the config check;
    ``extra``: optional (sum, max) vectors appended to the two messages (the diagnostics: no extra collective).

    Returns the reduced ``sums``, ``maxes`` (this config's sizes), a bool 0-dim tensor (all ranks agree) and the
    reduced extra vectors (or None)."""
    ns, nm = sums.numel(), maxes.numel()
    es = 0 if extra is None else extra[0].numel()
    em = 0 if extra is None else extra[1].numel()
    wire_s = sums.new_zeros(_WIRE_SUM + es)
    wire_s[:ns] = sums
    wire_m = maxes.new_full((_WIRE_MAX + em,), -math.inf)
    wire_m[:nm] = maxes
    if extra is not None:
        wire_s[_WIRE_SUM:] = extra[0]
        wire_m[_WIRE_MAX:] = extra[1]
    wire_m[_WIRE_MAX - 2] = float(fingerprint)
    wire_m[_WIRE_MAX - 1] = -float(fingerprint)
    dist.all_reduce(wire_s, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(wire_m, op=dist.ReduceOp.MAX, group=group)
    # max(h) == h and max(-h) == -h on this rank  <=>  min(h) == max(h) over all ranks: the same verdict everywhere.
    agree = (wire_m[_WIRE_MAX - 2] == fingerprint) & (wire_m[_WIRE_MAX - 1] == -fingerprint)
    rest = None if extra is None else (wire_s[_WIRE_SUM:], wire_m[_WIRE_MAX:])
    return wire_s[:ns], wire_m[:nm], agree, rest


def compute_rollout_correction(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    config: Union[RolloutCorrectionConfig, dict],
    *,
    dp_group=None,
    seq_group=None,
    nonfinite: str = "error",
    cu_seqlens: Optional[torch.Tensor] = None,
    diagnostics=None,
    empty: str = "error",
) -> Union[RolloutCorrectionResult, RolloutDiagnosticsResult]:
    """IS weights, the RS + veto mask and every ``rollout_corr/*`` metric, exact over the global batch.

    Padded batches are ``[B, T]``; **packed** batches (megatron's THD layout, sequence packing) are the 1-D token
    stream ``[T]`` (or megatron's ``[1, T]`` / ``[T, 1]``) with ``cu_seqlens`` ``[B + 1]`` (int32/int64: sequence b is
    tokens ``cu_seqlens[b]:cu_seqlens[b + 1]``). Every sequence-level quantity then reduces over each segment, in
    the kernels, without unpacking; the outputs keep the inputs' shape.

    Args:
        log_prob: ``[B, T]`` training-side log-probs (pi_old in decoupled mode, pi_theta in bypass mode); float16,
            bfloat16, float32 or float64; never differentiated through (the weights are detached).
        rollout_log_prob: ``[B, T]`` log-probs of the inference engine; any of those dtypes, not necessarily
            log_prob's (a mix is computed in the wider dtype; float16 with bfloat16 in float32).
        response_mask: ``[B, T]`` bool / int / float holding 0 and 1 (other values raise a ValueError naming the
            position). Its dtype is kept in the output.
        config: a :class:`RolloutCorrectionConfig` (or a dict of its fields). Every rank of ``dp_group`` must pass
            the same config and ``nonfinite``: a mismatch raises the same ValueError on every rank (CUDA: a device
            assert), detected through a fingerprint carried in the MAX all-reduce (no extra collective).
        dp_group: the ranks the global batch is split over (row counts may differ between them). With context
            parallelism this is the data-parallel group *with* context parallelism (megatron
            ``get_data_parallel_group(with_context_parallel=True)``); None: this process only (or ``seq_group``
            when only that is given).
        seq_group: the context-parallel group (each rank holds a slice of every sequence along T); per-sequence
            sums are all-reduced over it before sequence-level weights and rejections. Its ranks must hold the
            same number of rows (checked with one extra 16-byte all-reduce, a host sync on CUDA: ValueError on
            every rank otherwise).
        nonfinite: "error" (default): NaN/inf log-probs at valid positions raise; "exclude": those tokens are
            dropped (0 in the output mask and weights) and counted in ``rollout_corr/nonfinite_token_fraction``.
        cu_seqlens: packed layout (see above); ``response_mask`` then masks tokens inside the stream (prompt tokens,
            tool outputs, padding between segments). With context parallelism each rank passes its own local stream
            and local cu_seqlens: the same sequences in the same order, each rank its share of every sequence
            (megatron's ``cu_seqlens_q_padded // cp_size`` layout).
        diagnostics: a :class:`~rollout_corr_ext.observability.MismatchDiagnostics`: also compute the mismatch
            diagnostics (|lr| statistics, reverse KL, Jensen-Shannon, breakdowns by position / probability /
            entropy / turn / version lag, per-row values and rejection bits, the worst rows with global ids,
            logger-ready histograms; docs/rollout_correction.md "Diagnostics"): a stage of torch ops over the
            tokens (not fused: its cost is a row of benchmarks/bench_rollout_corr.py), its partials carried by the
            same two all-reduces. Returns a :class:`RolloutDiagnosticsResult` then.
        empty: a batch with no valid token over the whole ``dp_group`` (every mask 0, or every token excluded):
            "error" (default): a ValueError (CUDA: a device assert); "nan": not an error, the weights and mask are
            0 and every metric is NaN, a statistic of no tokens (megatron's ``loss_func`` asks for this: a
            micro-batch without response tokens contributes nothing, as without a correction).

    Returns:
        :class:`RolloutCorrectionResult` (weights: float32, float64 when either log-prob input is float64; or None;
        mask; metrics as 0-dim tensors; no host sync on CUDA without seq_group).
    """
    config = check_correction_inputs(log_prob, rollout_log_prob, response_mask, config, nonfinite, cu_seqlens)
    if empty not in ("error", "nan"):
        raise ValueError(f"empty must be 'error' or 'nan', got {empty!r}")
    out_shape = tuple(log_prob.shape)
    if cu_seqlens is not None:  # the kernels take the packed stream as 1-D views (no copy)
        log_prob, rollout_log_prob, response_mask = (t.reshape(-1) for t in (log_prob, rollout_log_prob,
                                                                             response_mask))
        if response_mask.shape != log_prob.shape or rollout_log_prob.shape != log_prob.shape:
            raise ValueError("log_prob, rollout_log_prob and response_mask must hold the same packed tokens")
        if diagnostics is not None and hasattr(diagnostics, "entropy"):  # its per-token tensors as 1-D views too
            import dataclasses

            n_tok = log_prob.numel()
            diagnostics = dataclasses.replace(diagnostics, **{
                k: getattr(diagnostics, k).reshape(-1) for k in ("entropy", "turn_ids", "versions", "positions",
                                                                  "position_mask")
                if isinstance(getattr(diagnostics, k), torch.Tensor) and getattr(diagnostics, k).dim() > 1
                and getattr(diagnostics, k).numel() == n_tok})
    exclude = nonfinite == "exclude"
    seq_world, seq_rank = _world(seq_group, "seq_group")
    red_group = dp_group if dp_group is not None else seq_group
    dp_world, _ = _world(red_group, "dp_group")
    args = op_args(config, exclude)
    # The weights and metrics are constants for autograd (IS changes the measure, not the objective). Mixed input
    # dtypes need no copy: the kernels read each input in its own dtype and compute in fp32 (fp64 if either is).
    log_prob, rollout_log_prob = log_prob.detach(), rollout_log_prob.detach()

    num_rows = log_prob.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if seq_world > 1:
        _check_seq_rows(num_rows, log_prob.device, seq_group)
    stats = ops.rollout_seq_stats(log_prob, rollout_log_prob, response_mask, args, cu_seqlens)
    diag_state = row_abs = None
    if diagnostics is not None:
        diag_state, row_abs = _diagnostics_first_half(diagnostics, log_prob, rollout_log_prob, response_mask,
                                                      cu_seqlens, num_rows)
    if seq_world > 1:
        ns = LY.SEQ_NUM_SUMS
        part = stats[:, :ns] if row_abs is None else torch.cat([stats[:, :ns], row_abs.to(stats.dtype)], 1)
        part = part.contiguous()
        dist.all_reduce(part, op=dist.ReduceOp.SUM, group=seq_group)
        top = stats[:, ns:].contiguous()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=seq_group)
        if row_abs is not None:
            part, row_abs = part[:, :ns], part[:, ns:]
        stats = torch.cat([part, top], dim=1)

    weights, mask_out, sums, maxes = ops.rollout_token_pass(
        log_prob, rollout_log_prob, response_mask, stats, args, seq_rank == 0, cu_seqlens)
    wire = row_values = None
    red_rank = dist.get_rank(red_group) if dp_world > 1 else 0
    lead_rank = red_rank  # the reduce-group rank of this row set's first context-parallel rank (global row ids)
    if diagnostics is not None and seq_world > 1 and dp_world > 1:
        lead_rank = dist.get_group_rank(red_group, dist.get_global_rank(seq_group, 0))
    if diagnostics is not None:
        wire, row_values = _diagnostics_second_half(diagnostics, diag_state, row_abs, stats, args, log_prob,
                                                    None if config.is_spec is None else weights, mask_out,
                                                    seq_rank, seq_world, dp_world, red_rank, cu_seqlens)
    agree = extra = None
    if dp_world > 1:
        fingerprint = config_fingerprint(config, exclude)
        if diagnostics is not None:
            fingerprint = _fold_fingerprint(fingerprint, diagnostics.fingerprint())
        sums, maxes, agree, extra = _reduce_partials(sums, maxes, fingerprint, red_group,
                                                     None if wire is None else wire.vectors())
    elif wire is not None:
        extra = wire.vectors()
    # Every rank reaches the same verdict on the reduced sums (CPU: a ValueError; CUDA: device asserts, no sync).
    sums = ops.rollout_check(sums, agree, log_prob, rollout_log_prob, response_mask, exclude, empty == "nan")

    metrics = finalize_metrics(sums, maxes, config, exclude, count_keeps_eps=LY.count_keeps_eps(response_mask.dtype))
    diag_out = None
    if diagnostics is not None:
        from .observability import finalize_diagnostics

        names = tuple(c.name for c in config.rs_criteria) + ("veto",)
        scale = None
        if config.is_spec is not None and config.rollout_is_batch_normalize:
            scale = 1.0 / metrics[PREFIX + "rollout_is_batch_norm_factor"]
        diag_metrics, diag_out = finalize_diagnostics(diagnostics, wire, extra[0], extra[1], lead_rank, row_values,
                                                      names, config.is_spec is not None, PREFIX, scale)
        metrics.update(diag_metrics)
    if config.is_spec is None:
        weights = None
    elif config.rollout_is_batch_normalize:
        # The global mean is known only after the reduce: one in-place scale of our own output.
        factor = metrics[PREFIX + "rollout_is_batch_norm_factor"]
        weights.mul_((1.0 / factor).to(weights.dtype))
    if empty == "nan":  # after the batch normalisation, whose factor (1 without tokens) is read above
        metrics = _nan_without_tokens(metrics, sums[LY.SUM["tokens"]])
    if cu_seqlens is not None:
        weights = None if weights is None else weights.reshape(out_shape)
        mask_out = mask_out.reshape(out_shape)
    if diag_out is not None:
        return RolloutDiagnosticsResult(weights, mask_out, metrics, diag_out)
    return RolloutCorrectionResult(weights, mask_out, metrics)


def _nan_without_tokens(metrics: Dict[str, torch.Tensor], tokens: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Every metric NaN when the (reduced) token count is 0: one where over the stacked values, no host sync."""
    if not metrics:
        return metrics
    if tokens.device.type == "cpu" and not torch.compiler.is_compiling() and float(tokens) > 0:  # the CPU check
        return metrics  # has read it already: the common case
    values = torch.stack([v.reshape(()).to(torch.float64) for v in metrics.values()])
    values = torch.where(tokens > 0, values, torch.full_like(values, math.nan))
    return {k: v.to(m.dtype) for (k, m), v in zip(metrics.items(), values.unbind())}


def _fold_fingerprint(fingerprint: int, extra) -> int:
    blob = repr((fingerprint, extra)).encode()
    return int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "little") % _FINGERPRINT_BUCKETS


def _diagnostics_first_half(spec, log_prob, rollout_log_prob, response_mask, cu_seqlens, num_rows):
    from .observability import MismatchDiagnostics, diagnostics_pass

    if not isinstance(spec, MismatchDiagnostics):
        raise TypeError(f"diagnostics must be a MismatchDiagnostics, got {type(spec).__name__}")
    # non-finite log-probs never count: excluded ("exclude"), or the call's own check refuses them ("error"), which
    # comes after this stage, so they must not reach its bucket indices (a NaN cast to int64)
    given = response_mask != 0
    valid = given & torch.isfinite(log_prob) & torch.isfinite(rollout_log_prob)
    return diagnostics_pass(spec, log_prob, rollout_log_prob, valid, cu_seqlens, num_rows, given)


def _diagnostics_second_half(spec, state, row_abs, stats, args, log_prob, weights, mask_out, seq_rank, seq_world,
                             world, rank, cu_seqlens):
    from .fallback.rollout_correction import row_rejections
    from .observability import diagnostics_partials

    f64 = torch.float64
    n = stats[:, LY.SEQ["tokens"]].to(f64)
    nan = torch.full((), math.nan, dtype=f64, device=n.device)

    def mean(s):
        return torch.where(n > 0, s.to(f64) / n.clamp(min=1), nan)

    bits = torch.zeros(n.shape, dtype=torch.int64, device=n.device)
    for i, hit in enumerate(row_rejections(stats, args, mask_out.dtype)):
        bits = bits | (hit.to(torch.int64) << i)
    lr_sum = stats[:, LY.SEQ["log_ratio"]].to(f64)
    # kl and k3_kl of the unclamped log-ratio, as the batch's metrics (the RS statistics clamp it to +-20)
    row_values = {"tokens": n.to(torch.int64), "log_ratio_sum": lr_sum, "log_ratio_mean": mean(lr_sum),
                  "abs_log_ratio_mean": mean(row_abs[:, 0]), "kl": mean(-lr_sum),
                  "k3_kl": mean(row_abs[:, 1]), "reject_bits": bits}
    state["pos_rows"] = row_abs[:, 2]  # the rows' counts of the tokens positions count among, over the CP group
    wire = diagnostics_partials(spec, state, log_prob, weights, mask_out, n, seq_rank, world, rank, seq_world > 1,
                                cu_seqlens, row_values)
    return wire, row_values


def compute_offpolicy_metrics(
    log_prob: torch.Tensor,
    rollout_log_prob: Optional[torch.Tensor],
    response_mask: torch.Tensor,
    *,
    dp_group=None,
    seq_group=None,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> Dict[str, torch.Tensor]:
    """verl's off-policy diagnostics alone (kl, k3_kl, ppl, log-ppl, ppl_ratio, chi2), ``rollout_corr/``-prefixed
    0-dim tensors, reduced like :func:`compute_rollout_correction` (padded or packed with ``cu_seqlens``).
    ``rollout_log_prob=None``: training ppl only."""
    only_training = rollout_log_prob is None
    if only_training:
        rollout_log_prob = log_prob
    res = compute_rollout_correction(log_prob, rollout_log_prob, response_mask, RolloutCorrectionConfig.disabled(),
                                     dp_group=dp_group, seq_group=seq_group, cu_seqlens=cu_seqlens)
    keys = ("training_ppl", "training_log_ppl") if only_training else OFFPOLICY_KEYS
    return {PREFIX + k: res.metrics[PREFIX + k] for k in keys}
