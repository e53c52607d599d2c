"""Mismatch observability: verl's rollout-vs-actor debug metrics, exact over data-parallel ranks.

verl 0.9.1 ``verl/utils/debug/metrics.py`` (``calculate_debug_metrics``) compares the probabilities the actor and the
rollout engine give each response token: p = exp(log pi_actor), q = exp(log pi_rollout), and over the response tokens

* ``training/rollout_probs_diff_valid``: 1 (0 when there is no response token; the others are then NaN),
* ``training/rollout_probs_diff_max`` / ``_mean`` / ``_std``: of |p - q| (std with Bessel's correction, as
  ``torch.std``),
* ``training/rollout_actor_probs_pearson_corr``: Pearson's correlation of p and q (the CISPO paper's mismatch
  check, arXiv:2506.13585).

verl computes them on each rank's micro-batch; :func:`debug_metrics` computes them from fp64 sums that add across
ranks, so with ``dp_group`` every rank gets the value of the whole data-parallel batch (one SUM and one MAX
all-reduce of a few numbers, whatever the batch size).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import _layout as LY
from ._checks import check_mask, ordered_sum

__all__ = ["DEBUG_METRIC_KEYS", "debug_metrics", "MismatchDiagnostics", "DiagnosticsOutput", "Histogram",
           "BREAKDOWNS", "BUCKET_STATS", "log_histograms"]

#: verl's keys, in its order.
DEBUG_METRIC_KEYS = ("training/rollout_probs_diff_valid", "training/rollout_probs_diff_max",
                     "training/rollout_probs_diff_mean", "training/rollout_probs_diff_std",
                     "training/rollout_actor_probs_pearson_corr")


def _centred(x: torch.Tensor, valid: torch.Tensor, total: torch.Tensor, n1: torch.Tensor,
             zero: torch.Tensor) -> torch.Tensor:
    """``x`` minus this rank's mean ``total / n1`` at valid tokens, 0 elsewhere: the summands of a rank's centred
    (co)moments, which do not cancel when the values spread little around a large mean."""
    return torch.where(valid, x - total / n1, zero)


def _pooled_comoment(centred: torch.Tensor, between: torch.Tensor, sx: torch.Tensor, sy: torch.Tensor,
                     n1: torch.Tensor) -> torch.Tensor:
    """The co-moment ``sum (x - mean_x)(y - mean_y)`` of ranks combined by SUM (Chan, Golub & LeVeque 1979): each
    rank sends its centred ``C_r`` and its between-means ``S_xr S_yr / n_r``; pooled, ``M = sum_r [C_r + S_xr S_yr
    / n_r] - S_x S_y / N``, whose bracketed second part is exactly ``S_x S_y / N`` on one rank."""
    return centred + (between - sx * sy / n1)


def debug_metrics(log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor, *,
                  dp_group=None) -> Dict[str, torch.Tensor]:
    """verl's ``calculate_debug_metrics`` on tensors (any shape, e.g. ``[B, T]`` or a packed ``[T]`` stream):
    ``log_prob`` the actor's (verl's ``old_log_probs``), ``rollout_log_prob`` the engine's, ``response_mask``
    (a token counts where it is non-zero). Returns 0-dim fp64 tensors under verl's keys, in verl's order (no host
    sync); with ``dp_group``, the values of the batch summed over that group. Inputs are not modified."""
    if not isinstance(log_prob, torch.Tensor) or not log_prob.is_floating_point():
        raise TypeError(f"log_prob must be a floating-point torch.Tensor, got "
                        f"{getattr(log_prob, 'dtype', type(log_prob))}")
    check_mask("rollout_log_prob", rollout_log_prob, log_prob)
    check_mask("response_mask", response_mask, log_prob)
    if not rollout_log_prob.is_floating_point():
        raise TypeError(f"rollout_log_prob must be floating point, got {rollout_log_prob.dtype}")
    with torch.no_grad():
        valid = response_mask != 0
        zero = torch.zeros((), dtype=torch.float64, device=log_prob.device)
        # p - 1 and q - 1 (expm1: exact for confident tokens, p near 1), then each statistic from centred sums
        # pooled over ranks (_pooled_comoment): one-pass sums of p p, q q, p q cancel to nothing when the
        # probabilities spread little (a Pearson correlation outside [-1, 1]); verl centres too (torch.std,
        # torch.corrcoef).
        p = torch.where(valid, torch.expm1(log_prob.detach().double()), zero)
        q = torch.where(valid, torch.expm1(rollout_log_prob.detach().double()), zero)
        d = (p - q).abs()
        n = valid.sum().double()
        n1 = n.clamp(min=1)
        # every sum in the values' logical order (ordered_sum): torch.where lays p, q out as the mask is, and a
        # sum in memory order moved the std by an ulp for a column-major mask (and with the thread count past
        # 32768 tokens; the input-layout fuzz)
        sd, sp, sq = ordered_sum(d), ordered_sum(p), ordered_sum(q)
        dc, pc, qc = (_centred(x, valid, s, n1, zero) for x, s in ((d, sd), (p, sp), (q, sq)))
        sums = torch.stack([n, sd, sp, sq, *(ordered_sum(x * y) for x, y in ((dc, dc), (pc, pc), (qc, qc), (pc, qc))),
                            sd * sd / n1, sp * sp / n1, sq * sq / n1, sp * sq / n1])
        # each side's max and -min (one MAX all-reduce): a constant side has no correlation (NaN) and a constant
        # difference a std of 0, which the centred sums miss by rounding (the mean sum / n is not exact: +-1 came out
        # of noise / noise; the versions fuzz)
        ends = [torch.where(valid, s * x, torch.full_like(x, -math.inf)).amax() if x.numel() else zero - math.inf
                for x in (d, p, q) for s in (1.0, -1.0)]
        ends = torch.stack(ends)
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            dist.all_reduce(sums, group=dp_group)
            dist.all_reduce(ends, op=dist.ReduceOp.MAX, group=dp_group)
        dmax, constant_d, constant_p, constant_q = ends[0], *(ends[i] == -ends[i + 1] for i in (0, 2, 4))
        n, sd, sp, sq, cdd, cpp, cqq, cpq, bdd, bpp, bqq, bpq = sums.unbind()
        nan = torch.full((), math.nan, dtype=torch.float64, device=log_prob.device)
        has = n > 0
        n1 = n.clamp(min=1)
        mean = sd / n1
        var = _pooled_comoment(cdd, bdd, sd, sd, n1) / (n - 1).clamp(min=1)  # Bessel-corrected, as torch.std
        std = torch.where(n > 1, torch.where(constant_d, zero, var.clamp(min=0).sqrt()), nan)
        cov = _pooled_comoment(cpq, bpq, sp, sq, n1)
        vp = _pooled_comoment(cpp, bpp, sp, sp, n1).clamp(min=0)
        vq = _pooled_comoment(cqq, bqq, sq, sq, n1).clamp(min=0)
        corr = (cov / (vp * vq).sqrt()).clamp(-1.0, 1.0)  # NaN stays NaN
        corr = torch.where(constant_p | constant_q, nan, corr)  # a constant side: undefined
        out = {
            DEBUG_METRIC_KEYS[0]: has.double(),
            DEBUG_METRIC_KEYS[1]: torch.where(has, dmax, nan),
            DEBUG_METRIC_KEYS[2]: torch.where(has, mean, nan),
            DEBUG_METRIC_KEYS[3]: torch.where(has, std, nan),
            DEBUG_METRIC_KEYS[4]: torch.where(has, corr, nan),
        }
    return out


# ------------------------------------------------------------------------------------------------- diagnostics
#
# ``compute_rollout_correction(..., diagnostics=MismatchDiagnostics(...))``: one more pass over the tokens (torch
# ops, no host sync) whose fp64 partials ride on the correction's own SUM / MAX all-reduce (no extra collective).
# Estimators, per response token with lr = log pi_theta - log pi_rollout, l = clamp(lr, -20, 20), r = e^l and the
# token drawn from pi_rollout (so E_rollout[f(r)] is the f-divergence D_f(pi_theta || pi_rollout) of the next-token
# distributions, averaged over the contexts the batch visits; Csiszar's f-divergences, e.g. Liese & Vajda 2006):
#   reverse KL(pi_theta || pi_rollout) = E[r l - (r - 1)]          f(r) = r log r - (r - 1): >= 0 per token, the
#       E[r - 1] = 0 control variate of Schulman's "Approximating KL divergence" (2020) k3, in the other direction;
#   Jensen-Shannon JS(pi_theta, pi_rollout) = E[(r l - (1 + r) log((1 + r) / 2)) / 2]   (Lin 1991; in nats,
#       <= log 2; f(r) >= 0 per token);
#   the forward KL(pi_rollout || pi_theta) is rollout_corr/kl (k1) and k3_kl (k3) on the unclamped lr, as verl logs
#   them; the breakdowns' and the rows' kl / k3_kl are the same terms, so the buckets add up to the batch's.

#: The scalar keys the diagnostics add (besides the ``by_<breakdown>/...`` keys), without the prefix.
DIAGNOSTICS_SCALAR_KEYS = ("abs_log_ratio_mean", "abs_log_ratio_max", "abs_log_ratio_std", "reverse_kl",
                           "js_divergence", "staleness_mean", "staleness_max", "staleness_min")


def is_diagnostics_key(key: str, prefix: str = "rollout_corr/") -> bool:
    """Whether a metric key is one the diagnostics add."""
    if not key.startswith(prefix):
        return False
    rest = key[len(prefix):]
    return rest in DIAGNOSTICS_SCALAR_KEYS or rest.startswith("by_")


#: Breakdown families, in wire order.
BREAKDOWNS = ("position_decile", "position", "probability", "entropy", "turn", "lag")
#: Per-bucket statistics of every breakdown.
BUCKET_STATS = ("tokens", "abs_log_ratio", "kl", "k3_kl", "rejected", "is_weight")
_HIST_BINS = 4096
_HIST_LO, _HIST_HI = -20.0, 20.0
_LN2 = math.log(2.0)


@dataclass(eq=False, frozen=True)
class MismatchDiagnostics:
    """What :func:`~rollout_corr_ext.compute_rollout_correction` adds when given ``diagnostics=`` (docs/
    rollout_correction.md, "Diagnostics"). Optional per-token tensors (the log-probs' shape; ``versions`` may be
    per row ``[B]``): ``entropy`` (the trainer's per-token entropy), ``turn_ids`` (integer turn index of each token in
    a multi-turn response; negative: not counted), ``versions`` with ``current_version`` (the policy version that
    drew each token), ``positions`` (each token's index among its sequence's response tokens: required under
    context parallelism, where a rank holds a slice of each sequence; derived from the mask otherwise),
    ``position_mask`` (the response mask those positions count in, when the correction's ``response_mask`` is a part
    of it: the position breakdowns then read each token's place in the whole response, and every token the
    correction counts must be in it; megatron's ``loss_func`` passes its caller's mask when sampling replay leaves
    tokens out; default: the correction's ``response_mask``, whose tokens keep their places when
    ``nonfinite="exclude"`` drops some).

    Buckets: ``position_buckets`` (absolute position edges), ``entropy_edges``, ``probability_bins`` (equal bins of
    the trainer's token probability), ``max_turns`` (turns >= it share the last bucket), ``max_lag`` (lags > it share
    the last bucket). ``top_k``: how many of the worst sequences (largest mean |lr|) to return, with global row ids
    over the data-parallel group. Every rank of the group must pass the same settings and the same optional tensors.
    """

    entropy: Optional[torch.Tensor] = None
    turn_ids: Optional[torch.Tensor] = None
    versions: Optional[torch.Tensor] = None
    current_version: Optional[int] = None
    positions: Optional[torch.Tensor] = None
    position_mask: Optional[torch.Tensor] = None
    position_buckets: Tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
    entropy_edges: Tuple[float, ...] = (0.1, 0.5, 1.0, 2.0, 4.0)
    probability_bins: int = 10
    max_turns: int = 8
    max_lag: int = 8
    top_k: int = 8

    def __post_init__(self) -> None:
        for name in ("probability_bins", "max_turns", "max_lag", "top_k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "probability_bins" else 0):
                raise ValueError(f"diagnostics.{name} must be an int >= {1 if name == 'probability_bins' else 0}, "
                                 f"got {v!r}")
        for name in ("position_buckets", "entropy_edges"):
            v = tuple(getattr(self, name))
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in v) \
                    or any(b <= a for a, b in zip(v, v[1:])):
                raise ValueError(f"diagnostics.{name} must be strictly increasing finite numbers, got {v!r}")
            object.__setattr__(self, name, v)
        pb = self.position_buckets
        if any(x != int(x) or x < 1 for x in pb):  # integral floats (64.0, from a YAML / JSON config) are taken
            raise ValueError(f"diagnostics.position_buckets must be whole numbers >= 1 (token positions), got {pb!r}")
        object.__setattr__(self, "position_buckets", tuple(int(x) for x in pb))
        if (self.versions is None) != (self.current_version is None):
            raise ValueError("diagnostics.versions and diagnostics.current_version go together (one is missing)")
        if self.current_version is not None:
            from .versions import check_current_version

            check_current_version(self.current_version, "diagnostics.current_version")

    def bucket_labels(self) -> Dict[str, List[str]]:
        """Each breakdown's bucket labels (the metric keys' middle part), for the breakdowns this spec has."""
        pb = self.position_buckets
        pos = [f"{a}-{b - 1}" for a, b in zip((0,) + pb, pb)] + [f"{pb[-1]}+" if pb else "0+"]
        n = self.probability_bins
        eh = self.entropy_edges
        pe = _distinct([i / n for i in range(n + 1)], 3)
        out = {"position_decile": [f"d{i}" for i in range(10)], "position": pos,
               "probability": [f"{a}-{b}" for a, b in zip(pe, pe[1:])]}
        if self.entropy is not None:
            ee = _distinct((0.0,) + eh, 6)
            out["entropy"] = [f"{a}-{b}" for a, b in zip(ee, ee[1:])] + [f"{ee[-1]}+" if eh else "0+"]
        if self.turn_ids is not None:
            out["turn"] = [str(i) for i in range(self.max_turns)] + [f"{self.max_turns}+"]
        if self.versions is not None:
            out["lag"] = [str(i) for i in range(self.max_lag + 1)] + [f"{self.max_lag + 1}+"]
        return out

    def with_positions_in(self, mask: torch.Tensor) -> "MismatchDiagnostics":
        """This spec with ``position_mask=mask`` unless it has one: for a caller whose correction sees a part of
        ``mask`` (sampling replay leaves the tokens outside the kept set out), so that positions, given or derived,
        still count among all of the caller's response tokens."""
        return self if self.position_mask is not None else dataclasses.replace(self, position_mask=mask)

    def fingerprint(self) -> Tuple:
        """What every data-parallel rank must agree on (the wire layout)."""
        return (self.position_buckets, self.entropy_edges, self.probability_bins, self.max_turns, self.max_lag,
                self.top_k, self.entropy is None, self.turn_ids is None, self.versions is None, self.current_version,
                self.positions is None, self.position_mask is None)


def _distinct(edges, digits: int) -> List[str]:
    """The increasing ``edges`` printed at the fewest significant digits d >= ``digits`` that tells them all apart:
    the bucket labels built from them name metric keys (two equal labels would overwrite each other's metrics, and a
    label ``0.5-0.5`` would hide its bucket's width). 17 digits tell any two doubles apart."""
    for d in range(digits, 18):
        text = [f"{e:.{d}g}" for e in edges]
        if len(set(text)) == len(text):
            return text
    return text


@dataclass(eq=False)
class Histogram:
    """A histogram in the form loggers take: ``edges`` ``[n + 1]`` and ``counts`` ``[n]`` (fp64), and the exact
    ``num``, ``min``, ``max``, ``sum``, ``sum_squares`` of the values (0-dim fp64; TensorBoard's
    ``add_histogram_raw`` asks for them). Exact over the data-parallel group."""

    edges: torch.Tensor
    counts: torch.Tensor
    num: torch.Tensor
    min: torch.Tensor
    max: torch.Tensor
    sum: torch.Tensor
    sum_squares: torch.Tensor

    def trimmed(self, max_bins: int = 512) -> "Histogram":
        """The non-empty range only, adjacent bins merged so at most ``max_bins`` remain (W&B takes at most 512).
        One host read."""
        if max_bins < 1:
            raise ValueError(f"max_bins must be >= 1, got {max_bins}")
        counts, edges = self.counts.detach().cpu(), self.edges.detach().cpu()
        nz = (counts > 0).nonzero().flatten()
        if nz.numel() == 0:
            return Histogram(edges[:2].clone(), counts[:1].clone() * 0, *(t.cpu() for t in (
                self.num, self.min, self.max, self.sum, self.sum_squares)))
        lo, hi = int(nz[0]), int(nz[-1]) + 1
        counts, edges = counts[lo:hi], edges[lo:hi + 1]
        step = -(-counts.numel() // max_bins)
        if step > 1:
            pad = (-counts.numel()) % step
            counts = torch.cat([counts, counts.new_zeros(pad)]).reshape(-1, step).sum(1)
            idx = torch.arange(0, edges.numel() - 1, step)
            edges = torch.cat([edges[idx], edges[-1:]])
        return Histogram(edges.clone(), counts.clone(), *(t.detach().cpu() for t in (
            self.num, self.min, self.max, self.sum, self.sum_squares)))

    def to_tensorboard(self, writer, tag: str, global_step: Optional[int] = None, max_bins: int = 512) -> None:
        """``writer.add_histogram_raw`` (torch.utils.tensorboard's SummaryWriter) with this histogram; TensorBoard's
        ``bucket_limits`` are the right edges."""
        h = self.trimmed(max_bins)
        writer.add_histogram_raw(tag, min=float(h.min), max=float(h.max), num=int(h.num), sum=float(h.sum),
                                 sum_squares=float(h.sum_squares), bucket_limits=h.edges[1:].tolist(),
                                 bucket_counts=h.counts.tolist(), global_step=global_step)

    def to_wandb(self, max_bins: int = 512):
        """A ``wandb.Histogram(np_histogram=(counts, edges))``."""
        import numpy as np
        import wandb

        h = self.trimmed(max_bins)
        return wandb.Histogram(np_histogram=(np.asarray(h.counts.tolist()), np.asarray(h.edges.tolist())))


@dataclass(eq=False)
class DiagnosticsOutput:
    """``rows``: per-sequence ``[B]`` tensors of this rank's rows (exact under context parallelism): ``tokens``,
    ``log_ratio_sum``, ``log_ratio_mean``, ``abs_log_ratio_mean``, ``kl`` (k1 mean), ``k3_kl`` (k3 mean),
    ``reject_bits`` (int64: bit i set when criterion ``reject_bit_names[i]`` dropped tokens of the row) and
    ``global_row`` (the row's index in the data-parallel batch: ranks in group order). ``worst``: the ``top_k``
    sequences of the whole batch with the largest ``abs_log_ratio_mean`` (the same on every rank), each field a
    ``[K]`` tensor; rows without response tokens are never among them, and a slot no row fills has ``global_row``
    -1, 0 tokens and reject bits, NaN values. ``histograms``: ``log_ratio`` (over the response tokens) and ``is_weight`` (the IS weights of
    the kept tokens; absent without IS), exact over the group."""

    rows: Dict[str, torch.Tensor]
    worst: Dict[str, torch.Tensor]
    histograms: Dict[str, Histogram]
    reject_bit_names: Tuple[str, ...]


def _like(name: str, t, ref: torch.Tensor, integer: bool) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"diagnostics.{name} must be a torch.Tensor, got {type(t).__name__}")
    if integer and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise TypeError(f"diagnostics.{name} must be an integer tensor, got {t.dtype}")
    if not integer and not t.is_floating_point():
        raise TypeError(f"diagnostics.{name} must be a floating-point tensor, got {t.dtype}")
    if t.device != ref.device:
        raise ValueError(f"diagnostics.{name} is on {t.device} but log_prob is on {ref.device}")
    return t


class _Wire:
    """Named fp64 segments of the extra SUM / MAX partials, and the value checks whose verdict rides the SUM."""

    #: the value checks, each one fixed slot of the SUM whether its tensor was given or not (a rank that passes
    #: ``positions`` and one that does not send partials of one size, and the config fingerprint tells them apart)
    REFUSALS = ("diagnostics.versions", "diagnostics.positions", "diagnostics.entropy", "diagnostics.position_mask")

    def __init__(self, device):
        self.sum_parts: List[Tuple[str, torch.Tensor]] = []
        self.max_parts: List[Tuple[str, torch.Tensor]] = []
        self.refused = torch.zeros(len(self.REFUSALS), dtype=torch.float64, device=device)
        self.sum_parts.append(("refused", self.refused))
        self.refusals: Dict[int, tuple] = {}

    def refuse(self, name: str, bad: torch.Tensor, describe, message: str) -> None:
        """:func:`refuse_where` of the check ``name``, decided on the reduced count of ``bad`` (:meth:`verdict`):
        every rank of the reduce raises alike, where a check on one rank's tokens would leave the others waiting in
        a later collective."""
        i = self.REFUSALS.index(name)
        self.refused[i] = bad.sum()
        self.refusals[i] = (bad, describe, message)

    def verdict(self, parts: Dict[str, torch.Tensor]) -> None:
        """On CPU a ValueError naming this rank's first offending token (or the count on other ranks); on CUDA an
        asynchronous device assert on every rank (no host sync)."""
        counts = parts["refused"]
        for i, name in enumerate(self.REFUSALS):
            bad, describe, message = self.refusals.get(i, (None, None, f"{name} holds a bad value"))
            if counts.device.type != "cpu":
                torch._assert_async(counts[i] == 0, message)
            elif float(counts[i]) > 0:
                if bad is not None and bool(bad.any()):
                    raise ValueError(describe(tuple(int(j) for j in bad.nonzero()[0])))
                raise ValueError(f"{message} (at {int(counts[i])} response tokens of other ranks)")

    def vectors(self):
        return (torch.cat([t.reshape(-1) for _, t in self.sum_parts]),
                torch.cat([t.reshape(-1) for _, t in self.max_parts]))

    def split(self, sums: torch.Tensor, maxes: torch.Tensor) -> Dict[str, torch.Tensor]:
        out, i = {}, 0
        for name, t in self.sum_parts:
            out[name] = sums[i:i + t.numel()].reshape(t.shape)
            i += t.numel()
        i = 0
        for name, t in self.max_parts:
            out[name] = maxes[i:i + t.numel()].reshape(t.shape)
            i += t.numel()
        return out


def _row_index(cu_seqlens: Optional[torch.Tensor], shape, device) -> torch.Tensor:
    """Each token's row; packed tokens past the last segment get row B (dropped)."""
    if cu_seqlens is None:
        b, t = shape
        return torch.arange(b, device=device).unsqueeze(1).expand(b, t)
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    return torch.searchsorted(cu[1:], torch.arange(shape[0], device=device), right=True)


def _binned(index: torch.Tensor, keep: torch.Tensor, values: torch.Tensor, size: int) -> torch.Tensor:
    """Sums of ``values`` per ``index`` in [0, size) where ``keep``; fixed shapes throughout (the dropped values go
    to a spare last bin), so no host sync on CUDA (unlike boolean indexing or bincount)."""
    at = torch.where(keep.reshape(-1), index.reshape(-1), size)
    out = torch.zeros(size + 1, dtype=values.dtype, device=values.device)
    return out.index_add_(0, at, values.reshape(-1))[:size]


def _count_at_least(x: torch.Tensor, edges) -> torch.Tensor:
    """The bucket of each value: how many of the (few, ascending) ``edges`` it reaches (``bucketize(right=True)``),
    by comparisons with Python numbers: no boundary tensor to copy to the device, so no host sync on CUDA."""
    out = torch.zeros(x.shape, dtype=torch.int64, device=x.device)
    for e in edges:
        out += x >= e
    return out


def _row_sum(values: torch.Tensor, row: torch.Tensor, num_rows: int) -> torch.Tensor:
    return _binned(row.clamp(max=num_rows), row < num_rows, values, num_rows)


def diagnostics_pass(spec: MismatchDiagnostics, log_prob, rollout_log_prob, valid, cu_seqlens, num_rows: int,
                     response: torch.Tensor = None):
    """Per-token partials (first half: before the context-parallel row reduce): returns the state and each row's
    local sum of |lr| (to be summed over the context-parallel group with the correction's row statistics).
    ``valid``: the tokens that count; ``response``: the response tokens (mask != 0, ``valid`` when None), which
    positions count among unless ``spec.position_mask`` names others (a token ``nonfinite="exclude"`` drops keeps
    its place)."""
    dev = log_prob.device
    shape = tuple(log_prob.shape)
    row = _row_index(cu_seqlens, shape, dev)
    valid = valid & (row < num_rows)
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    lr = torch.where(valid, log_prob.double() - rollout_log_prob.double(), zero)
    state = {"row": row, "valid": valid, "lr": lr}
    # the tokens positions count among: the response tokens, or position_mask's (the caller's response mask, when
    # the correction's mask is a part of it, e.g. sampling replay's kept tokens); each row's count joins the
    # context-parallel row reduce
    pos_valid = (valid if response is None else response) & (row < num_rows)
    if spec.position_mask is not None:
        pm = spec.position_mask
        if not isinstance(pm, torch.Tensor) or pm.is_complex():
            raise TypeError(f"diagnostics.position_mask must be a bool, integer or float tensor, got "
                            f"{getattr(pm, 'dtype', type(pm).__name__)}")
        if pm.device != dev:
            raise ValueError(f"diagnostics.position_mask is on {pm.device} but log_prob is on {dev}")
        if tuple(pm.shape) != shape:
            raise ValueError(f"diagnostics.position_mask must have log_prob's shape {shape}, got {tuple(pm.shape)}")
        pos_valid = (pm != 0) & (row < num_rows)
    state["pos_valid"] = pos_valid
    if spec.versions is not None:
        v = _like("versions", spec.versions, log_prob, True)
        if tuple(v.shape) == shape:
            pass
        elif tuple(v.shape) == (num_rows,):
            v = v[row.clamp(max=max(num_rows - 1, 0))] if num_rows else v.new_zeros(shape)
        else:
            raise ValueError(f"diagnostics.versions must have log_prob's shape {shape} or one value per sequence "
                             f"({num_rows},), got {tuple(v.shape)}")
        from .versions import policy_lag

        refusals = state["refusals"] = []  # made in the second half, on the wire (_Wire.refuse)
        state["lag"] = policy_lag(v, spec.current_version, valid, "diagnostics.versions",
                                  refuse=lambda *check: refusals.append(check))
    # each row's sums of |lr| and of the unclamped k3 (as the batch's k3_kl), summed over the context-parallel group
    # with the correction's row statistics
    return state, torch.stack([_row_sum(lr.abs(), row, num_rows), _row_sum(torch.expm1(lr) - lr, row, num_rows),
                               _row_sum(pos_valid.to(torch.float64), row, num_rows)], 1)


def diagnostics_partials(spec: MismatchDiagnostics, state, log_prob, weights, mask_out, row_tokens,
                         seq_rank: int, world: int, rank: int, positions_needed: bool, cu_seqlens,
                         row_values: Dict[str, torch.Tensor]):
    """The SUM / MAX partials of every diagnostic (second half: after the row reduce, with each row's total
    response tokens ``row_tokens`` and the row values)."""
    dev = log_prob.device
    row, valid, lr = state["row"], state["valid"], state["lr"]  # lr is 0 at every token that does not count
    pos_valid = state["pos_valid"]
    num_rows = row_tokens.numel()
    # each row's count of the tokens positions count among (reduced over the context-parallel group with the row
    # statistics)
    pos_rows = state.get("pos_rows", row_tokens)
    f64 = torch.float64
    zero = torch.zeros((), dtype=f64, device=dev)
    ninf = torch.full((), -math.inf, dtype=f64, device=dev)
    n_tok = lr.numel()
    # Per-token statistics, one column each, all 0 at a token that does not count (lr = 0 gives r = 1 and 0 for
    # every estimator), so the breakdowns are plain index_adds of this matrix's rows: one pass per breakdown.
    kept = valid & (mask_out != 0)
    l20 = lr.clamp(-LY.SAFETY_BOUND, LY.SAFETY_BOUND)
    rm1 = torch.expm1(l20)  # r - 1, accurate for small lr
    r = rm1 + 1.0
    rl = r * l20
    abs_lr = lr.abs()
    # count, |lr|, k1, k3: on the unclamped lr, as the batch's kl and k3_kl (so the buckets add up to them)
    cols = [valid.to(f64), abs_lr, -lr, torch.expm1(lr) - lr]
    cols.append((valid & ~kept).to(f64))  # rejected: the RS criteria or the veto dropped it
    if weights is not None:
        cols += [kept.to(f64), torch.where(kept, weights.to(f64), zero)]
    stats = torch.stack([c.reshape(-1) for c in cols], 1)  # [N, C]
    rev = rl - rm1
    js = 0.5 * (rl - (1.0 + r) * (torch.nn.functional.softplus(l20) - _LN2))
    w = _Wire(dev)
    for check in state.get("refusals", ()):
        w.refuse("diagnostics.versions", *check)
    # |lr|'s spread from centred sums pooled over ranks (_pooled_comoment): no cancellation of a small spread
    # against a large mean
    # (every sum in the tokens' logical order, ordered_sum: the same bits in any layout and at any thread count)
    n_loc, s_loc = ordered_sum(stats[:, 0]), ordered_sum(stats[:, 1])
    centred = _centred(abs_lr, valid, s_loc, n_loc.clamp(min=1), zero)
    w.sum_parts.append(("scalars", torch.stack([n_loc, s_loc, ordered_sum(centred * centred),
                                                s_loc * s_loc / n_loc.clamp(min=1), ordered_sum(rev),
                                                ordered_sum(js)])))
    w.max_parts.append(("abs_max", (torch.where(valid, abs_lr, ninf).amax() if n_tok else ninf).reshape(1)))

    # ---- breakdowns: a bucket index per token and breakdown (the spare last bucket takes tokens not counted)
    labels = spec.bucket_labels()
    safe_row = row.clamp(max=max(num_rows - 1, 0))
    if spec.positions is not None:
        pos = _like("positions", spec.positions, log_prob, True)
        if tuple(pos.shape) != tuple(log_prob.shape):
            raise ValueError(f"diagnostics.positions must have log_prob's shape {tuple(log_prob.shape)}, got "
                             f"{tuple(pos.shape)}")
        pos = pos.to(torch.int64)
    else:
        if positions_needed:
            raise ValueError("diagnostics.positions is required under context parallelism (seq_group): each token's "
                             "index among its sequence's response tokens, which a rank holding a slice cannot know")
        if cu_seqlens is None:
            pos = torch.cumsum(pos_valid.to(torch.int64), dim=1) - 1
        else:
            c = torch.cumsum(pos_valid.to(torch.int64), dim=0)
            cu = cu_seqlens.to(device=dev, dtype=torch.int64)
            start = torch.cat([c.new_zeros(1), c])[cu[:-1]] if num_rows else c.new_zeros(0)
            pos = c - 1 - (start[safe_row] if num_rows else 0)
    n_row = pos_rows.to(f64)[safe_row] if num_rows else torch.zeros_like(lr)
    if spec.positions is not None:  # a position no bucket holds is an error, not a clamp into the edge buckets
        w.refuse("diagnostics.positions", valid & ((pos < 0) | (pos.to(f64) >= n_row)),
                 lambda at: f"diagnostics.positions at response token {at} is {int(pos[at])}, outside [0, "
                            f"{int(n_row[at])}) (its index among its sequence's {int(n_row[at])} response tokens)",
                 "diagnostics.positions must lie in [0, the sequence's response tokens) at response tokens")
    if spec.position_mask is not None:  # positions count among its tokens: every counted token must be one
        w.refuse("diagnostics.position_mask", valid & ~pos_valid,
                 lambda at: f"diagnostics.position_mask at response token {at} is 0: it must cover every token the "
                            f"correction counts (its positions are indices among the position_mask's tokens)",
                 "diagnostics.position_mask must be nonzero at every response token")
    fam_idx = {"position_decile": torch.where(n_row > 0, (pos.to(f64) * 10 / n_row.clamp(min=1)).floor(),
                                              zero).clamp(0, 9).long(),
               "position": _count_at_least(pos, spec.position_buckets),
               "probability": (log_prob.detach().to(f64).exp() * spec.probability_bins).floor().clamp(
                   0, spec.probability_bins - 1).long()}
    extra_valid = {}
    if spec.entropy is not None:
        ent = _like("entropy", spec.entropy, log_prob, False)
        if tuple(ent.shape) != tuple(log_prob.shape):
            raise ValueError(f"diagnostics.entropy must have log_prob's shape {tuple(log_prob.shape)}, got "
                             f"{tuple(ent.shape)}")
        bad = valid & ~torch.isfinite(ent)  # a NaN would land in the first bucket unseen
        w.refuse("diagnostics.entropy", bad,
                 lambda at: f"diagnostics.entropy at response token {at} is {float(ent.detach()[at])}: entropies "
                            f"must be finite", "diagnostics.entropy must be finite at response tokens")
        fam_idx["entropy"] = _count_at_least(ent.detach().to(f64), spec.entropy_edges)
    if spec.turn_ids is not None:
        tid = _like("turn_ids", spec.turn_ids, log_prob, True)
        if tuple(tid.shape) != tuple(log_prob.shape):
            raise ValueError(f"diagnostics.turn_ids must have log_prob's shape {tuple(log_prob.shape)}, got "
                             f"{tuple(tid.shape)}")
        fam_idx["turn"] = tid.to(torch.int64).clamp(0, spec.max_turns)
        extra_valid["turn"] = tid >= 0
    if spec.versions is not None:
        fam_idx["lag"] = state["lag"].clamp(0, spec.max_lag + 1)
    blocks = []
    for fam in BREAKDOWNS:
        if fam not in fam_idx:
            continue
        nb = len(labels[fam])
        ok = valid if fam not in extra_valid else valid & extra_valid[fam]
        at = torch.where(ok, fam_idx[fam], nb).reshape(-1)
        blocks.append(torch.zeros((nb + 1, stats.shape[1]), dtype=f64, device=dev).index_add_(0, at, stats)[:nb])
    w.sum_parts.append(("buckets", torch.cat(blocks).t().contiguous()))  # [C, buckets]

    # ---- histograms (fixed edges, so they add across ranks)
    width = (_HIST_HI - _HIST_LO) / _HIST_BINS
    hidx = ((l20 - _HIST_LO) / width).floor().clamp(0, _HIST_BINS - 1).long()
    w.sum_parts.append(("hist_lr", _binned(hidx, valid, stats[:, 0], _HIST_BINS)))
    w.sum_parts.append(("hist_lr_moments", torch.stack([ordered_sum(lr), ordered_sum(lr * lr)])))
    w.max_parts.append(("hist_lr_minmax", torch.stack([
        torch.where(valid, lr, ninf).amax() if n_tok else ninf,
        torch.where(valid, -lr, ninf).amax() if n_tok else ninf])))
    if weights is not None:
        wt = stats[:, 6].reshape(lr.shape)
        pos_w = kept & (wt > 0)
        lw = torch.where(pos_w, wt.clamp(min=1e-300).log(), zero).clamp(_HIST_LO, _HIST_HI)
        widx = torch.where(pos_w, ((lw - _HIST_LO) / width).floor().clamp(0, _HIST_BINS - 1).long() + 1,
                           torch.zeros_like(hidx))
        w.sum_parts.append(("hist_w", _binned(widx, kept, stats[:, 5], _HIST_BINS + 1)))
        w.sum_parts.append(("hist_w_moments", torch.stack([ordered_sum(stats[:, 5]), ordered_sum(wt),
                                                           ordered_sum(wt * wt)])))
        w.max_parts.append(("hist_w_minmax", torch.stack([
            torch.where(kept, wt, ninf).amax() if n_tok else ninf,
            torch.where(kept, -wt, ninf).amax() if n_tok else ninf])))

    # ---- staleness (versions)
    if spec.versions is not None:
        lagv = state["lag"]
        lagf = torch.where(valid, lagv.to(f64), zero)
        w.sum_parts.append(("lag_sum", ordered_sum(lagf).reshape(1)))
        w.max_parts.append(("lag_minmax", torch.stack([
            torch.where(valid, lagv.to(f64), ninf).amax() if lagv.numel() else ninf,
            torch.where(valid, -lagv.to(f64), ninf).amax() if lagv.numel() else ninf])))

    # ---- global row ids and the worst rows: every rank writes its own slots (context-parallel ranks but the
    # first write nothing, their rows being the first's)
    k = spec.top_k
    counts = torch.zeros(world, dtype=f64, device=dev)
    own = seq_rank == 0
    if own:
        counts[rank] = float(num_rows)
    w.sum_parts.append(("row_counts", counts))
    if k:
        score = row_values["abs_log_ratio_mean"]
        has = row_tokens > 0
        kk = min(k, num_rows)
        vals = torch.full((world, k), -math.inf, dtype=f64, device=dev)
        fields = torch.zeros((world, k, len(_WORST_FIELDS)), dtype=f64, device=dev)
        if own and kk:
            top = torch.topk(torch.where(has, score.to(f64), ninf), kk)
            vals[rank, :kk] = top.values
            fields[rank, :kk] = torch.stack([row_values[f].to(f64)[top.indices] if f != "local_row" else
                                             top.indices.to(f64) for f in _WORST_FIELDS], dim=1)
        w.max_parts.append(("worst_vals", vals))
        w.sum_parts.append(("worst_fields", fields))
    return w


_WORST_FIELDS = ("local_row", "tokens", "log_ratio_sum", "kl", "k3_kl", "reject_bits")


def finalize_diagnostics(spec: MismatchDiagnostics, wire: _Wire, sums: torch.Tensor, maxes: torch.Tensor,
                         lead_rank: int, row_values: Dict[str, torch.Tensor], reject_bit_names: Tuple[str, ...],
                         has_weights: bool, prefix: str = "rollout_corr/", weight_scale=None):
    """Metrics (0-dim fp64) and the :class:`DiagnosticsOutput` from the reduced partials; ``lead_rank``: the
    reduce-group rank that wrote this rank's row count (its context-parallel group's first rank); ``weight_scale``:
    the factor batch normalisation multiplies the weights by after the reduce (a 0-dim tensor), applied here to
    the weight statistics (exactly: means, extrema and the histogram's edges scale; its counts do not move)."""
    ws = 1.0 if weight_scale is None else weight_scale.to(torch.float64)
    p = wire.split(sums, maxes)
    wire.verdict(p)
    f64 = torch.float64
    dev = sums.device
    nan = torch.full((), math.nan, dtype=f64, device=dev)
    n, s_abs, m2_abs, b_abs, s_rev, s_js = p["scalars"].unbind()
    has = n > 0
    n1 = n.clamp(min=1)
    mean_abs = s_abs / n1
    var = _pooled_comoment(m2_abs, b_abs, s_abs, s_abs, n1) / (n - 1).clamp(min=1)
    m = {prefix + "abs_log_ratio_mean": torch.where(has, mean_abs, nan),
         prefix + "abs_log_ratio_max": torch.where(has, p["abs_max"][0], nan),
         prefix + "abs_log_ratio_std": torch.where(n > 1, var.clamp(min=0).sqrt(), nan),
         prefix + "reverse_kl": torch.where(has, s_rev / n1, nan),
         prefix + "js_divergence": torch.where(has, s_js / n1, nan)}
    labels = spec.bucket_labels()
    b = p["buckets"]
    col = 0
    for fam in BREAKDOWNS:
        if fam not in labels:
            continue
        for lab in labels[fam]:
            cnt = b[0, col]
            nonempty = cnt > 0
            key = f"{prefix}by_{fam}/{lab}/"
            m[key + "tokens"] = cnt
            for j, stat in enumerate(BUCKET_STATS[1:5], start=1):
                m[key + stat] = torch.where(nonempty, b[j, col] / cnt.clamp(min=1), nan)
            if has_weights:
                n_kept = b[5, col]
                m[key + "is_weight"] = torch.where(n_kept > 0, ws * b[6, col] / n_kept.clamp(min=1), nan)
            col += 1
    if spec.versions is not None:
        mm = p["lag_minmax"]
        m[prefix + "staleness_mean"] = torch.where(has, p["lag_sum"][0] / n1, nan)
        m[prefix + "staleness_max"] = torch.where(has, mm[0], nan)
        m[prefix + "staleness_min"] = torch.where(has, -mm[1], nan)

    hists = {}
    edges = torch.linspace(_HIST_LO, _HIST_HI, _HIST_BINS + 1, dtype=f64, device=dev)
    mo, mx = p["hist_lr_moments"], p["hist_lr_minmax"]
    hists["log_ratio"] = Histogram(edges, p["hist_lr"], n, -mx[1], mx[0], mo[0], mo[1])
    if has_weights:
        wm, wx = p["hist_w_moments"], p["hist_w_minmax"]
        wedges = torch.cat([torch.zeros(1, dtype=f64, device=dev), edges.exp()])
        hists["is_weight"] = Histogram(wedges * ws, p["hist_w"], wm[0], -wx[1] * ws, wx[0] * ws, wm[1] * ws,
                                       wm[2] * ws * ws)

    counts = p["row_counts"]
    offset = counts[:lead_rank].sum()
    rows = dict(row_values)
    num_rows = rows["tokens"].numel()
    rows["global_row"] = (offset.to(torch.int64) + torch.arange(num_rows, device=dev))
    worst: Dict[str, torch.Tensor] = {}
    if spec.top_k:
        vals = p["worst_vals"].reshape(-1)
        fields = p["worst_fields"].reshape(-1, len(_WORST_FIELDS))
        k = min(spec.top_k, vals.numel())
        top = torch.topk(vals, k)
        live = torch.isfinite(top.values)
        starts = torch.cumsum(counts, 0) - counts
        src_rank = top.indices // spec.top_k
        f = fields[top.indices]
        worst = {"global_row": (starts[src_rank] + f[:, 0]).to(torch.int64),
                 "abs_log_ratio_mean": top.values,
                 "tokens": f[:, 1].to(torch.int64), "log_ratio_sum": f[:, 2], "kl": f[:, 3], "k3_kl": f[:, 4],
                 "reject_bits": f[:, 5].to(torch.int64)}
        # fewer rows with response tokens than top_k in the whole batch: the empty slots say so (global_row -1, NaN
        # values), alike in one process and over ranks (whose unwritten slots hold 0); no host read
        for key, t in worst.items():
            empty = -1 if key == "global_row" else (0 if key in ("tokens", "reject_bits") else math.nan)
            worst[key] = torch.where(live, t, torch.full_like(t, empty))
    return m, DiagnosticsOutput(rows, worst, hists, reject_bit_names)


def log_histograms(histograms, step: Optional[int] = None, *, tensorboard=None, wandb_run=None,
                   prefix: str = "rollout_corr/", max_bins: int = 512) -> None:
    """Log the histograms of a diagnostics result (a :class:`DiagnosticsOutput`, a result carrying one, or a
    ``{name: Histogram}`` dict) to a TensorBoard ``SummaryWriter`` (``add_histogram_raw``) and/or a W&B run
    (``run.log({tag: wandb.Histogram(np_histogram=...)}, step=step)``, one call), under ``prefix + name``."""
    if hasattr(histograms, "diagnostics"):
        histograms = histograms.diagnostics
    if isinstance(histograms, DiagnosticsOutput):
        histograms = histograms.histograms
    if not isinstance(histograms, dict) or not all(isinstance(h, Histogram) for h in histograms.values()):
        raise TypeError("histograms must be a DiagnosticsOutput, a result with diagnostics, or a dict of Histogram")
    if tensorboard is None and wandb_run is None:
        raise ValueError("give tensorboard= (a SummaryWriter) and/or wandb_run= (a wandb run)")
    if tensorboard is not None:
        for name, h in histograms.items():
            h.to_tensorboard(tensorboard, prefix + name, step, max_bins)
    if wandb_run is not None:
        wandb_run.log({prefix + name: h.to_wandb(max_bins) for name, h in histograms.items()}, step=step)
