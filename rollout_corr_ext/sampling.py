"""Sampling replay: log-probs under the distribution the sampler really drew from (docs/sampling_replay.md).

An inference engine samples from ``softmax(z)`` truncated by min-p, top-k and top-p and renormalised; a trainer that
scores the same token under the full ``softmax(logits)`` sees every ratio multiplied by the row's kept mass. This
module replays the engine's truncation on the trainer's logits, exactly and under tensor parallelism, without ever
holding more than a rank's vocabulary shard:

1. ``z = logits / temperature`` (fp32; fp64 for fp64 logits), as vLLM's V1 sampler divides its fp32 logits;
2. min-p keeps ``p_u >= min_p * p_max``, i.e. ``exp(z_u - z_max) >= min_p`` (vLLM's ``MinPLogitsProcessor``,
   applied after temperature, before top-k / top-p);
3. top-k keeps every value ``>=`` the k-th largest of what min-p kept (vLLM ``apply_top_k_top_p``: ties with the k-th
   value are kept);
4. top-p, on the distribution renormalised over what 1-3 kept: vLLM sorts ascending, takes the cumulative sum and
   drops the positions where it is ``<= 1 - top_p`` (never the last, the top token). Equal values are one group
   here: a group is kept whole when the cumulative mass through its last member exceeds ``1 - top_p`` (the vLLM rule
   applied to the group's last position; vLLM itself splits a tied group by sort order).

Every step keeps an upper set of ``z``, so a row's kept set is ``{u: z_u >= tau}`` for one threshold ``tau``; the
log-probs are then the plain vocab-parallel log-probs of the logits with everything below ``tau`` masked to -inf
(the existing kernels: the gradient is the renormalised softmax's over the kept set and exactly 0 outside).

The threshold search exchanges per-row summaries only (the max, the top-k candidates, integer partial masses): the
masses ``round(exp(z_u - z_max) * 2^40)`` are int64, whose sums do not depend on the order or the sharding, so every
decision is the same at every tensor-parallel size.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import hashlib
import json
import math
import numbers
import re
import struct
from typing import NamedTuple, Optional, Union

import torch
import torch.distributed as dist

from . import _layout as LY
from . import logprobs as _lp
from . import ops
from ._checks import check_mask, ordered_sum, row_sums
from .fallback import logprob as _fallback_lp  # the targets' fingerprint, as the log-prob record headers hold it

Number = Union[int, float]
#: fixed-point scale of the top-p masses (2^-40 of the top token's probability; sums stay < 2^63 for V < 2^22)
MASS_BITS = 40
#: below this many nats under the row's max, a quantized mass is exactly 0 (e^-64 * 2^40 < 0.5)
_MASS_FLOOR = 64.0


def _field_tensor(name: str, value) -> Optional[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        if value.dim() > 1:
            raise ValueError(f"SamplingParams.{name}: a per-row tensor must be 1-D (one value per row), got shape "
                             f"{tuple(value.shape)}")
        if value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"SamplingParams.{name}: expected a real tensor, got {value.dtype}")
        if value.requires_grad:
            raise ValueError(f"SamplingParams.{name} requires grad, but a sampling parameter is a constant: no "
                             f"gradient flows to it (pass it detached)")
        return value
    return None


#: vLLM raises a request's temperature in (0, VLLM_MIN_TEMPERATURE) to it before its sampler sees it
#: (``vllm/sampling_params.py``, ``SamplingParams.__post_init__`` and ``_MAX_TEMP``, 0.33.0): such a request is
#: drawn at this temperature, whatever its config says.
VLLM_MIN_TEMPERATURE = 1e-2

#: SGLang samples greedily (top_k = 1 at temperature 1) below this temperature
#: (``sglang/srt/sampling/sampling_params.py``, ``_SAMPLING_EPS``, 0.5.23).
SGLANG_GREEDY_TEMPERATURE = 1e-6


def engine_family(engine: Optional[str]) -> str:
    """verl's ``rollout.name`` as the engine family whose sampler is known here: "vllm" (also None: a config
    without a name is taken as vLLM's), "sglang", or the name itself (another engine)."""
    name = "vllm" if engine is None else str(engine).lower()
    return "vllm" if name.startswith("vllm") else "sglang" if name.startswith("sglang") else name


def engine_temperature(temperature: float, engine: Optional[str] = None) -> float:
    """The temperature a rollout engine samples with when configured with ``temperature`` (a number): vLLM's
    (``engine`` None or a name starting with "vllm") raises one in (0, :data:`VLLM_MIN_TEMPERATURE`) to that value;
    SGLang samples greedily below :data:`SGLANG_GREEDY_TEMPERATURE` (a point mass, no temperature: refused);
    other engines' are taken as configured."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"engine_temperature: temperature must be a number (a request's), got "
                        f"{type(temperature).__name__}")
    kind = engine_family(engine)
    if kind == "vllm" and 0 < temperature < VLLM_MIN_TEMPERATURE:
        return VLLM_MIN_TEMPERATURE
    if kind == "sglang" and 0 <= temperature < SGLANG_GREEDY_TEMPERATURE:
        raise ValueError(f"engine_temperature: SGLang samples greedily at a temperature below "
                         f"{SGLANG_GREEDY_TEMPERATURE:g} (top_k=1 at temperature 1; got {temperature!r}): the tokens "
                         f"are drawn from a point mass, which no temperature replays and no importance weight "
                         f"corrects")
    return temperature


#: vLLM's speculative-decoding rejection methods that accept a draft token by another rule than the target's
#: probability (``vllm/config/speculative.py``, ``RejectionSampleMethod``, 0.33.0): "synthetic" accepts drafts at a
#: set rate whatever the target gives them (a token the truncation removed included), "fly" is lossy by vLLM's own
#: account. The tokens are then not drawn from the distribution whose log-probs vLLM still reports (the target's
#: processed ones); "standard" (the default) and "block" draw exactly from it.
VLLM_LOSSY_REJECTION_METHODS = ("synthetic", "fly")


def vllm_engine_kwargs(rollout_config) -> dict:
    """verl's ``rollout.engine_kwargs.vllm`` as its vLLM server passes them to the engine (verl 0.9.1,
    ``workers/rollout/vllm_rollout/vllm_async_server.py``): None values dropped, a "-" in a key read as "_" (vLLM's
    command line takes both). The server spreads them after its own arguments, so a ``logprobs_mode`` here is the
    one vLLM runs with, whatever ``rollout.logprobs_mode`` says, and a ``speculative_config`` here applies with or
    without verl's ``mtp``."""
    def get(obj, key):
        return obj.get(key, None) if hasattr(obj, "get") else getattr(obj, key, None)

    kwargs = get(get(rollout_config, "engine_kwargs") or {}, "vllm") or {}
    if not hasattr(kwargs, "items"):
        raise TypeError(f"rollout config: engine_kwargs.vllm must be a mapping, got {type(kwargs).__name__}")
    return {str(k).replace("-", "_"): v for k, v in kwargs.items() if v is not None}


def _check_vllm_engine_kwargs(kwargs: dict) -> None:
    """Refuse the vLLM engine options (verl's ``engine_kwargs.vllm``) under which the tokens are not drawn from the
    tempered, truncated distribution of the raw logits whose log-probs vLLM reports: no replay matches them."""
    spec = kwargs.get("speculative_config")
    if isinstance(spec, str):  # verl json.loads a string (build_mtp_speculative_config), as vLLM's CLI does
        try:
            spec = json.loads(spec)
        except ValueError:
            raise ValueError(f"rollout config: engine_kwargs.vllm.speculative_config is neither a mapping nor "
                             f"JSON: {spec!r}") from None
    if spec is not None:
        if not hasattr(spec, "get"):
            raise ValueError(f"rollout config: engine_kwargs.vllm.speculative_config must be a mapping, got "
                             f"{type(spec).__name__}")
        method = spec.get("rejection_sample_method", None)
        if method is not None and str(method).lower() in VLLM_LOSSY_REJECTION_METHODS:
            raise ValueError(f"rollout config: engine_kwargs.vllm.speculative_config.rejection_sample_method="
                             f"{method!r}: vLLM then accepts draft tokens by another rule than the target's "
                             f"probability (lossy speculative decoding), so the tokens are not drawn from the "
                             f"distribution whose log-probs it reports, and neither a replay nor an importance "
                             f"weight corrects that. Use 'standard' (vLLM's default) or 'block'")
    procs = kwargs.get("logits_processors")
    if procs is not None and (not hasattr(procs, "__len__") or isinstance(procs, str) or len(procs)):
        raise ValueError(f"rollout config: engine_kwargs.vllm.logits_processors={procs!r}: vLLM applies custom "
                         f"logits processors before the temperature and the truncation, so what it draws from and "
                         f"the processed log-probs it reports include their change, which the trainer's logits and "
                         f"this replay do not. Build a SamplingParams by hand if they leave verl's requests "
                         f"untouched")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """What the inference engine sampled with; each field a Python number or a per-row 1-D tensor (engines accept
    per-request parameters). Defaults leave the distribution untouched.

    temperature: > 0 (finite). top_k: ``None`` (or 0 / -1, vLLM's and verl's "disabled") or an int >= 1; in a
    per-row tensor, values <= 0 disable that row. top_p: in (0, 1]; 1 disables. min_p: in [0, 1); 0 disables.
    """

    temperature: Union[Number, torch.Tensor] = 1.0
    top_k: Union[None, int, torch.Tensor] = None
    top_p: Union[Number, torch.Tensor] = 1.0
    min_p: Union[Number, torch.Tensor] = 0.0

    def __post_init__(self):
        checks = {
            "temperature": (lambda v: torch.isfinite(v) & (v > 0), "finite and > 0"),
            "top_p": (lambda v: (v > 0) & (v <= 1), "in (0, 1]"),
            "min_p": (lambda v: (v >= 0) & (v < 1), "in [0, 1)"),
        }
        for name, (ok, what) in checks.items():
            value = getattr(self, name)
            t = _field_tensor(name, value)
            if t is None:
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise TypeError(f"SamplingParams.{name} must be a number or a 1-D tensor, got "
                                    f"{type(value).__name__}")
                t = torch.tensor(float(value), dtype=torch.float64)
            bad = ~ok(t.to(torch.float64))
            if bool(bad.any()):
                v = t.reshape(-1)[bad.reshape(-1).nonzero()[0, 0]].item() if t.dim() else t.item()
                raise ValueError(f"SamplingParams.{name} must be {what}, got {v!r}")
        k = self.top_k
        t = _field_tensor("top_k", k)
        if t is not None:
            if t.is_floating_point():
                raise TypeError(f"SamplingParams.top_k: a per-row tensor must hold integers, got {t.dtype}")
        elif k is not None and (isinstance(k, bool) or not isinstance(k, int)):
            raise TypeError(f"SamplingParams.top_k must be None, an int or a 1-D integer tensor, got "
                            f"{type(k).__name__}")
        elif k is not None and not -1 <= k < 2 ** 63:
            raise ValueError(f"SamplingParams.top_k must be >= 1 (below 2**63), or None / 0 / -1 (disabled), got {k}")

    @classmethod
    def from_verl(cls, rollout_config) -> "SamplingParams":
        """From verl's rollout config (``actor_rollout_ref.rollout``: ``temperature``, ``top_k`` (-1: disabled),
        ``top_p``); a mapping or an object with those attributes. A ``min_p`` other than 0 (or None) is refused:
        verl does not pass one to its engine. The temperature is the one the engine
        samples with (``name``, verl's engine: vLLM, the default, raises one below 0.01 to 0.01,
        :func:`engine_temperature`): these parameters replay the sampler on **raw** logits
        (``make_policy_loss_func(sampling=)``, the log-prob entry points). verl's actor divides its logits by the
        configured temperature itself and then needs the engine's processed log-probs: in verl use
        :func:`rollout_corr_ext.verl.sampling_params`, which sets the temperature to what is left to apply (1, or
        the engine's over the configured one) and checks ``logprobs_mode``.

        The rules replayed are vLLM's, and a truncation (top-k, top-p, min-p) is replayed for vLLM only: SGLang
        (0.5.23) reports the log-probs of softmax(logits / T) before its truncation, not of the truncated
        distribution it draws from, and takes top-p on the full distribution; another engine's rules are not known
        here. Both are refused with a truncation (docs/sampling_replay.md, "Engines"); a temperature alone is
        replayed for every engine. For vLLM, verl's ``engine_kwargs.vllm`` are read too (:func:`vllm_engine_kwargs`):
        a lossy speculative decoding (:data:`VLLM_LOSSY_REJECTION_METHODS`) and custom ``logits_processors`` are
        refused (the tokens are not drawn from what a replay computes)."""
        get = rollout_config.get if hasattr(rollout_config, "get") else lambda k, d: getattr(rollout_config, k, d)

        def number(key, default):  # None or text is the config's mistake: named, never a bare float() error
            value = get(key, default)
            try:
                if value is None or isinstance(value, bool):
                    raise TypeError
                return float(value)
            except (TypeError, ValueError):
                raise ValueError(f"rollout config: {key} must be a number, got {value!r}") from None

        def integer(key, value):  # an int, or a string / float that is one exactly (int() would truncate 4.7)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                return int(value)
            if isinstance(value, str) and re.fullmatch(r"\s*[+-]?[0-9]+\s*", value):  # ASCII digits only
                return int(value)
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ValueError(f"rollout config: {key} must be an integer (-1 or 0: disabled), got {value!r}")

        top_k = get("top_k", -1)
        top_k = None if top_k is None else integer("top_k", top_k)
        min_p = get("min_p", 0.0)
        name = get("name", None)
        sp = cls(temperature=engine_temperature(number("temperature", 1.0), name),
                 top_k=None if top_k in (None, 0, -1) else int(top_k), top_p=number("top_p", 1.0),
                 min_p=0.0 if min_p is None else number("min_p", 0.0))
        if sp.min_p != 0.0:
            raise ValueError(f"rollout config: min_p={sp.min_p}: verl passes temperature, top_k and top_p to its "
                             f"rollout engine, not min_p (verl 0.9.1 has no such field; experimental/agent_loop/"
                             f"agent_loop.py), so the rollout was not drawn with it and replaying it would truncate "
                             f"what the engine did not. Build SamplingParams(min_p=...) by hand where an engine did "
                             f"apply it")
        kind = engine_family(name)
        if kind != "vllm" and not (sp.top_k is None and sp.top_p == 1.0):
            what = f"top_k={sp.top_k}, top_p={sp.top_p}"
            if kind == "sglang":
                why = ("SGLang draws from the truncated distribution but reports the log-probs of softmax(logits / "
                       "T) before the truncation, and takes top-p on the full distribution (vLLM, whose rules are "
                       "replayed, renormalises after top-k and min-p; sglang/srt/layers/sampler.py, 0.5.23): a "
                       "replay would compare renormalised log-probs with unrenormalised ones. Leave the sampling "
                       "replay off for SGLang rollouts (the rollout correction then measures the mismatch of the "
                       "untruncated distributions), or roll out with vLLM and logprobs_mode=processed_logprobs")
            else:
                why = (f"the replay follows vLLM V1's sampler and processed log-probs, and the truncation rules "
                       f"and reported log-probs of engine {name!r} are not known to match them (checked: vLLM; "
                       f"SGLang, which does not). Build a SamplingParams by hand if the engine samples and reports log-probs as vLLM "
                       f"does with processed_logprobs")
            raise ValueError(f"rollout config: name={name!r} with a truncation ({what}): {why}")
        if kind == "vllm":
            _check_vllm_engine_kwargs(vllm_engine_kwargs(rollout_config))
        return sp

    @classmethod
    def from_megatron(cls, sampling_params, *, logprobs_mode) -> Optional["SamplingParams"]:
        """From megatron-core's inference ``SamplingParams`` (``megatron.core.inference.sampling_params``:
        ``temperature``, ``top_k`` (0: disabled), ``top_p`` (0.0: disabled); a mapping or an object with those
        attributes) and the engine's ``logprobs_mode`` (``InferenceConfig.logprobs_mode``, megatron-core 0.19 on:
        the string, or the config itself). The result is for ``make_policy_loss_func(sampling=)`` and the log-prob
        entry points, which replay it on **raw** logits.

        ``"raw_logprobs"`` (megatron-core's default, and all that 0.16 has): the engine reports ``log_softmax`` of
        the raw logits, untruncated and at temperature 1, whatever it sampled with, so there is nothing to replay:
        returns ``None`` (no replay; a temperature replayed against raw log-probs would itself be a mismatch).
        ``"processed_logprobs"``: the engine reports the log-probs of the tempered, truncated, renormalised
        distribution it draws from (``sampling/torch_sampling.py`` ``log_probs_kernel``: temperature, then top-k or
        top-p; ``sampling/flashinfer_sampling.py``: top-k, then top-p on the renormalised top-k, vLLM's order):
        returns the replay of it. Where the rules differ from vLLM's, which the replay follows: Megatron's torch
        top-p keeps a token when the mass before it is at most p (vLLM: below p), and splits ties by its sort order
        (docs/sampling_replay.md, "Engines"). A temperature below 1e-6 is refused (the torch backend divides by it,
        FlashInfer's raises it to 1e-6: which one drew the rollout is not known here)."""
        mode = getattr(logprobs_mode, "logprobs_mode", logprobs_mode)
        if mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError(f"SamplingParams.from_megatron: logprobs_mode must be 'raw_logprobs' or "
                             f"'processed_logprobs' (megatron-core's InferenceConfig.logprobs_mode), got {mode!r}")
        if isinstance(sampling_params, collections.abc.Mapping):  # any mapping by key (a dict, a read-only view)
            get = sampling_params.get
        else:
            def get(key, default):
                return getattr(sampling_params, key, default)
        temperature, top_k, top_p = get("temperature", 1.0), get("top_k", 0), get("top_p", 0.0)
        for key, value, kinds in (("temperature", temperature, numbers.Real), ("top_k", top_k, numbers.Integral),
                                  ("top_p", top_p, numbers.Real)):
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise TypeError(f"SamplingParams.from_megatron: sampling_params.{key} must be "
                                f"{'an int' if kinds is numbers.Integral else 'a number'}, got {value!r}")
        if not (math.isfinite(temperature) and temperature >= 1e-6):
            raise ValueError(f"SamplingParams.from_megatron: sampling_params.temperature={temperature!r}: below "
                             f"1e-6 megatron-core's torch sampler divides by it and its FlashInfer sampler raises "
                             f"it to 1e-6, so what the rollout was drawn from depends on the backend")
        if top_k < 0:
            raise ValueError(f"SamplingParams.from_megatron: sampling_params.top_k must be >= 0 (0: disabled), got "
                             f"{top_k}")
        if not 0.0 <= top_p <= 1.0:
            raise ValueError(f"SamplingParams.from_megatron: sampling_params.top_p must be in [0, 1] (0: disabled), "
                             f"got {top_p!r}")
        if mode == "raw_logprobs":
            return None
        return cls(temperature=float(temperature), top_k=int(top_k) if top_k > 0 else None,
                   top_p=float(top_p) if top_p > 0.0 else 1.0)


def _per_row(name: str, value, rows: int, lead, dtype, device) -> torch.Tensor:
    """A field as ``[rows]`` (a number broadcast; a tensor of ``rows`` or of the leading shape's size)."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 1 and value.dim() == 0:
            return value.to(device=device, dtype=dtype).expand(rows)
        if value.numel() != rows:
            raise ValueError(f"SamplingParams.{name}: a per-row tensor needs one value per row ({rows} = "
                             f"{tuple(lead)} rows here), got {value.numel()}")
        return value.reshape(rows).to(device=device, dtype=dtype)
    return torch.full((rows,), float(value) if dtype.is_floating_point else int(value), dtype=dtype, device=device)


def _check_entry(sampling, n: int, lead, tp_group, vocab_size, what: str) -> None:
    """The checks both entry points share: the spec's type, each per-row field's size, and a whole-vocab call under
    megatron's tensor parallelism (as ``vocab_parallel_log_probs`` refuses it)."""
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    for name in ("temperature", "top_k", "top_p", "min_p"):
        value = getattr(sampling, name)
        if isinstance(value, torch.Tensor):
            _per_row(name, value, n, lead, value.dtype, value.device)
    if tp_group is None and vocab_size is None and _lp.megatron_tp_size() > 1:
        raise ValueError(
            f"tp_group=None, but megatron-core is initialized with tensor-parallel size {_lp.megatron_tp_size()}: "
            f"{what} probably one vocab shard. Pass tp_group; for a whole vocabulary on this rank, pass vocab_size "
            f"explicitly")


def _check_temperature(temperature, dtype) -> None:
    """Every temperature in range for the dtype the logits are scaled in (as ``vocab_parallel_log_probs`` checks
    its own): outside it, z = logits / T overflows or flushes for a reason that is not in the logits."""
    if isinstance(temperature, torch.Tensor):
        t = temperature.detach().to(torch.float64).reshape(-1)
        if t.numel():
            for v in (t.min().item(), t.max().item()):
                _lp.checked_inv_temperature(v, dtype)
    else:
        _lp.checked_inv_temperature(temperature, dtype)


def _ordered_key(z: torch.Tensor) -> torch.Tensor:
    """int64 keys with the order of the float values (``-0.0`` counts as ``0.0``; no NaN here)."""
    z = z + 0.0  # -0.0 + 0.0 = +0.0: equal values get equal keys
    if z.dtype == torch.float64:
        bits = z.view(torch.int64)
        return torch.where(bits < 0, bits ^ 0x7FFFFFFFFFFFFFFF, bits)
    bits = z.view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _key_to_value(key: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float64:
        return torch.where(key < 0, key ^ 0x7FFFFFFFFFFFFFFF, key).view(torch.float64)
    k = torch.where(key < 0, key ^ 0x7FFFFFFF, key).to(torch.int32)
    return k.view(torch.float32)


def _midpoint(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """floor((lo + hi) / 2) without overflow."""
    return (lo >> 1) + (hi >> 1) + (lo & hi & 1)


def _bisection_probes(lo: torch.Tensor, hi: torch.Tensor, levels: int) -> torch.Tensor:
    """``2^levels - 1`` sorted points of each row's ``[lo, hi]`` by repeated bisection (no product that could overflow:
    fp64 keys span more than int64)."""
    points = [lo, hi]
    for _ in range(levels):
        nxt = [points[0]]
        for a, b in zip(points, points[1:]):
            nxt += [_midpoint(a, b), b]
        points = nxt
    return torch.stack(points[1:-1], dim=1)


def _probes(lo: torch.Tensor, hi: torch.Tensor, levels: int, acc: torch.dtype) -> torch.Tensor:
    """``2^levels - 1`` ascending points of each row's ``[lo, hi]`` (keys of ``acc`` values): ``[rows, 2^levels - 1]``.
    32-bit keys: the grid ``lo + floor(j (hi - lo) / 2^levels)`` (``j (hi - lo) < 2^(levels + 33)``), whose bucket
    the CPU kernel computes without a search; 64-bit keys: bisection."""
    if acc == torch.float64:
        return _bisection_probes(lo, hi, levels)
    j = torch.arange(1, 2 ** levels, dtype=torch.int64, device=lo.device)
    return lo.unsqueeze(1) + (((hi - lo).unsqueeze(1) * j) >> levels)


def _all_reduce(t: torch.Tensor, op, group, world: int) -> torch.Tensor:
    if world > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


#: rows per chunk of the local passes (their fp64 temporaries are [chunk, V_local])
CHUNK_ROWS = 256


class KeptSet(NamedTuple):
    threshold: torch.Tensor  # [N] acc dtype: the kept set is {u: z_u >= threshold, z_u > -inf}
    log_kept_mass: torch.Tensor  # [N] acc dtype
    fast_top_p: bool  # whether top-p was decided on the gathered top-k candidates alone

    def mask(self, z: torch.Tensor, r0: int = 0) -> torch.Tensor:
        """The kept set of rows ``r0:r0 + len(z)`` of ``z``."""
        return (z >= self.threshold[r0:r0 + z.shape[0]].unsqueeze(1)) & (z != -math.inf)


def _masses(values: torch.Tensor, z_max: torch.Tensor) -> torch.Tensor:
    """round(exp(z - z_max) * 2^MASS_BITS) as int64 (0 at -inf): order-free exact sums."""
    rel = values.to(torch.float64) - z_max.to(torch.float64).unsqueeze(1)
    return torch.where(values == -math.inf, torch.zeros_like(rel),
                       torch.exp(rel) * float(2 ** MASS_BITS)).round().to(torch.int64)


def _mass_at_or_below(sorted_key: torch.Tensor, cum: torch.Tensor, probes: torch.Tensor) -> torch.Tensor:
    """M(<= probe) per row from ascending keys and their cumulative masses."""
    idx = torch.searchsorted(sorted_key, probes, right=True)
    return torch.where(idx > 0, cum.gather(1, (idx - 1).clamp_min(0)), torch.zeros_like(idx))


def _top_p_budget(total: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """c = floor((1 - p) M): a value v is kept iff M(<= v) > c; never the top token (c < M)."""
    c = torch.floor((1.0 - top_p) * total.to(torch.float64)).to(torch.int64)
    return torch.minimum(c, total - 1)


def _top_p_key(cand: torch.Tensor, mult: Optional[torch.Tensor], z_max: torch.Tensor,
               top_p: torch.Tensor) -> torch.Tensor:
    """The key of each row's top-p threshold when every survivor of the earlier filters is among ``cand`` (-inf
    elsewhere; ``mult``: how many values each entry stands for, None for one): the smallest v with M(<= v) > c."""
    q = _masses(cand, z_max)
    if mult is not None:
        q = q * mult
    c = _top_p_budget(q.sum(-1), top_p)
    key = _ordered_key(cand)
    sorted_key, order = key.sort(dim=-1)
    cum = q.gather(1, order).cumsum(-1)
    over = _mass_at_or_below(sorted_key, cum, sorted_key) > c.unsqueeze(1)
    return torch.where(over, sorted_key, torch.full_like(sorted_key, torch.iinfo(torch.int64).max)).amin(1)


def _ceil_to(t64: torch.Tensor, acc) -> torch.Tensor:
    """The smallest ``acc`` value >= each fp64 threshold (so ``z >= result`` iff ``z >= t64`` for ``acc`` z)."""
    if acc == torch.float64:
        return t64
    t = t64.to(acc)
    return torch.where(t.to(torch.float64) < t64, torch.nextafter(t, torch.full_like(t, math.inf)), t)


def _min_p_floor(z_max64: torch.Tensor, min_p: torch.Tensor, mp_on: torch.Tensor, acc) -> torch.Tensor:
    """min-p keeps p_u >= min_p * p_max, i.e. z_u >= z_max + log(min_p): that threshold (fp64) as the smallest
    ``acc`` value at or above it, -inf where min-p is off."""
    return _ceil_to(torch.where(mp_on, z_max64 + torch.log(min_p.clamp_min(1e-300)),
                                torch.full_like(min_p, -math.inf)), acc)


def _row_max(pieces, rows: int, acc, device) -> torch.Tensor:
    m = torch.full((rows,), -math.inf, dtype=acc, device=device)
    for z in pieces:
        m = torch.maximum(m, z.amax(-1))  # propagates NaN
    return m


def _row_topk(pieces, width: int) -> torch.Tensor:
    """The ``width`` largest of each row over every piece, descending (-inf padded when a row has fewer): one
    pass per piece in the CPU kernel (``ops.row_topk``), radix-select rounds in the CUDA kernel."""
    tops = [ops.row_topk(z, width) for z in pieces]
    return tops[0] if len(tops) == 1 else ops.row_topk(torch.cat(tops, 1), width)


def kept_set(z_of, n: int, v_local: int, acc, device, params: SamplingParams, rows_active: torch.Tensor, lead,
             group, world: int, allow_fast_top_p: bool = True, chunks=None, pieces=None, row_id=None,
             what: str = "logit in row {} of the flattened logits", with_log_s: bool = True,
             extra_settings=(), vocab_size: Optional[int] = None, fn: str = "sampled_log_probs") -> KeptSet:
    """Each row's threshold (the kept set is ``{u: z_u >= threshold}``) and the log of the kept set's mass under
    ``softmax(z)``; ``z_of(r0, r1)`` gives rows ``r0:r1`` of the scaled logits (-inf at excluded columns).
    Collective over ``group`` (every rank calls it with its shard). The local passes run ``CHUNK_ROWS`` rows at a
    time (or the given ``chunks`` of row ranges; ``pieces(r0, r1)``, when given, yields those rows' logits in column
    pieces instead of ``z_of``); the per-row decisions (max, k-th value, top-p threshold) are exchanged as small
    summaries. ``allow_fast_top_p=False`` forces the general top-p search (the tests hold the two to the same kept
    sets). ``row_id(i)``: the caller's row of row ``i``, ``what``: how an error names it. ``with_log_s=False``: no
    log S (``log_kept_mass`` None), one pass over the logits less. ``extra_settings``: the caller's settings
    (``ignore_index``, the logits' dtype, ...) that join ``params`` in the fingerprint every rank compares. ``fn``:
    the entry point its errors name.
    ``vocab_size``: the whole vocabulary (the same on every rank); a row's top-k of at least that many keeps every
    token, so it runs as top-k off (a top_k of 10**8 made every shard keep a list that long)."""
    if chunks is None:
        chunks = [(r0, min(r0 + CHUNK_ROWS, n)) for r0 in range(0, n, CHUNK_ROWS)]
    if pieces is None:
        def pieces(r0, r1):
            yield z_of(r0, r1)

    def parts(r0, r1):  # the non-empty column pieces of rows r0:r1
        return (z for z in pieces(r0, r1) if z.shape[1])

    ninf = -math.inf
    min_p = _per_row("min_p", params.min_p, n, lead, torch.float64, device)
    mp_on = (min_p > 0) & rows_active
    k_on = torch.zeros(n, dtype=torch.bool, device=device)
    k_max = 0
    if params.top_k is not None:
        k = _per_row("top_k", params.top_k, n, lead, torch.int64, device)
        k_on = (k > 0) & rows_active
        if vocab_size is not None:
            k_on &= k < vocab_size
        k_max = min(int(k[k_on].max()), 2 ** 31) if bool(k_on.any()) else 0
        k_on &= k_max > 0
    early_topk = k_max > 0 and not bool(mp_on.any())  # top-k needs no max without min-p: one pass for both

    z_max = torch.full((n,), ninf, dtype=acc, device=device)
    # each shard's k_max + 1 largest: the extra one tells whether the list holds every value >= the threshold
    width = k_max + 1
    local = torch.full((n, width), ninf, dtype=acc, device=device) if k_max else None
    for r0, r1 in chunks:
        if early_topk:
            zs = list(parts(r0, r1))
            z_max[r0:r1] = _row_max(zs, r1 - r0, acc, device)
            if zs:
                local[r0:r1] = _row_topk(zs, width)
            del zs
        else:
            z_max[r0:r1] = _row_max(parts(r0, r1), r1 - r0, acc, device)
    z_max = _refuse_non_finite(z_max, rows_active, group, world, fn, what, row_id,
                               settings=lambda: _sampling_settings(params, acc, *extra_settings))
    z_max = torch.where(torch.isfinite(z_max), z_max, torch.zeros_like(z_max))  # an all -inf row is refused later

    # min-p: p_u >= min_p * p_max, i.e. z_u >= z_max + log(min_p) (in fp64; as a threshold in z's dtype)
    tau = _min_p_floor(z_max.to(torch.float64), min_p, mp_on, acc)

    def above_tau(r0, r1):  # the pieces with everything under tau at -inf
        t = tau[r0:r1].unsqueeze(1)
        return (torch.where(z >= t, z, torch.full_like(z, ninf)) for z in parts(r0, r1))

    # top-k: every value >= the k-th largest of what min-p kept; the k-th largest of the union of the shards is the
    # k-th largest of the union of each shard's k largest.
    cand = None
    if k_max > 0:
        if not early_topk:
            for r0, r1 in chunks:
                zs = list(above_tau(r0, r1))
                if zs:
                    local[r0:r1] = _row_topk(zs, width)
                del zs
        if world > 1:
            local = _lp.all_gather(local.reshape(-1).contiguous(), group, world).reshape(world, n, width)
            local = local.permute(1, 0, 2).reshape(n, world * width)
        cand = torch.where(local >= tau.unsqueeze(1), local, torch.full_like(local, ninf))
        top = cand.topk(k_max, dim=-1).values  # descending
        kth = top.gather(1, (k.clamp(1, k_max) - 1).unsqueeze(1)).squeeze(1)
        tau = torch.where(k_on, torch.maximum(tau, kth), tau)

    # top-p on the renormalised survivors: keep a value v iff M(<= v) > (1 - p) M, in integer masses.
    top_p = _per_row("top_p", params.top_p, n, lead, torch.float64, device)
    p_on = (top_p < 1) & rows_active
    fast = False
    mult = None
    if bool(p_on.any()):
        if allow_fast_top_p and cand is not None and bool((k_on | ~p_on).all()):
            # Every top-p row has a top-k: its survivors are the gathered candidates >= tau, unless a shard has more
            # values >= tau than its list holds. A shard's list is sorted and one longer than k_max, and its last
            # entry is <= tau (tau >= the k-th largest >= any shard's (k_max + 1)-th): it misses nothing when that
            # entry is below tau (or -inf), and otherwise only a run of values equal to tau, which is counted (one
            # pass, one all-reduce; bf16 logits tie often) and added as one weighted candidate. Every rank sees
            # every list, so the search itself needs no collective.
            last = local.reshape(n, world, width)[:, :, -1]
            complete = ((last < tau.unsqueeze(1)) | (last == ninf)).all(1)
            cand = torch.where(cand >= tau.unsqueeze(1), cand, torch.full_like(cand, ninf))
            mult = torch.ones(cand.shape, dtype=torch.int64, device=device)
            if not bool(complete[p_on].all()):
                count = torch.zeros(n, dtype=torch.int64, device=device)
                for r0, r1 in chunks:
                    t = tau[r0:r1].contiguous()
                    for z in parts(r0, r1):
                        count[r0:r1] += ops.count_at_least(z, t)
                count = _all_reduce(count, dist.ReduceOp.SUM, group, world)
                missing = (count - (cand != ninf).sum(-1)).clamp_min(0)
                cand = torch.cat([cand, torch.where(missing > 0, tau, torch.full_like(tau, ninf)).unsqueeze(1)], 1)
                mult = torch.cat([mult, missing.unsqueeze(1)], 1)
            fast = True
        if fast:  # every rank holds the same candidates
            hi = _top_p_key(cand, mult, z_max, top_p)
        else:  # the general search: bisection of the key space, a histogram of every shard's survivors per round
            # 2^levels - 1 probes per round: 255 in one process (4 rounds for fp32 keys, no collective), 15 under
            # tensor parallelism (8 rounds, 128 bytes per row each). base = M(<= lo): each round then needs the
            # masses inside the bracket only, and the first round's histogram also gives the total M.
            levels = 8 if world == 1 else 4
            hi = _ordered_key(z_max)
            lo = _ordered_key((z_max.to(torch.float64) - _MASS_FLOOR).to(acc)) - 1  # M(<= lo) = 0 <= c
            lo = torch.where(p_on, lo, hi - 1)  # inactive rows start converged
            base = torch.zeros(n, dtype=torch.int64, device=device)
            c = None
            while c is None or bool((hi > lo + 1).any()):  # not hi - lo: fp64 keys span more than int64
                probes = _probes(lo, hi, levels, acc)  # [n, 2^levels - 1], ascending
                hist = torch.zeros((n, probes.shape[1] + 1), dtype=torch.int64, device=device)
                for r0, r1 in chunks:
                    args = (z_max[r0:r1].contiguous(), tau[r0:r1].contiguous(), lo[r0:r1].contiguous(),
                            hi[r0:r1].contiguous(), probes[r0:r1].contiguous())
                    for z in parts(r0, r1):
                        hist[r0:r1] += ops.mass_histogram(z, *args)
                hist = _all_reduce(hist, dist.ReduceOp.SUM, group, world)
                if c is None:  # the first bracket holds every positive mass
                    c = _top_p_budget(hist.sum(1), top_p)
                mass = base.unsqueeze(1) + hist.cumsum(1)[:, :-1]  # M(<= probe j), non-decreasing in j
                at_or_under = (mass <= c.unsqueeze(1)).sum(1)  # the probes with M <= c are a prefix
                last = (at_or_under - 1).clamp_min(0).unsqueeze(1)
                first_over = at_or_under.clamp_max(probes.shape[1] - 1).unsqueeze(1)
                moved = at_or_under > 0
                lo = torch.where(moved, probes.gather(1, last).squeeze(1), lo)
                base = torch.where(moved, mass.gather(1, last).squeeze(1), base)
                hi = torch.where(at_or_under < probes.shape[1], probes.gather(1, first_over).squeeze(1), hi)
        tau = torch.where(p_on, torch.maximum(tau, _key_to_value(hi, acc)), tau)

    if not with_log_s:  # the caller takes log S from the log-prob kernels' row states
        return KeptSet(tau, None, fast)
    # log S: the kept mass over the total, both relative to the row max (sums in z's dtype, then fp64: their
    # rounding is far below a metric's). With the candidates complete, every rank already holds the kept mass of
    # the top-p rows.
    need_kept = ~(p_on & fast) & rows_active
    any_kept = bool(need_kept.any())
    sums = torch.zeros((n, 2), dtype=torch.float64, device=device)
    for r0, r1 in chunks:
        t = tau[r0:r1].unsqueeze(1)
        for z in parts(r0, r1):
            e = torch.exp(z - z_max[r0:r1].unsqueeze(1))
            if any_kept:
                sums[r0:r1, 0] += row_sums(torch.where(z >= t, e, torch.zeros_like(e))).double()
            sums[r0:r1, 1] += row_sums(e).double()  # a lone row of a wide vocab: one order at any thread count
    sums = _all_reduce(sums, dist.ReduceOp.SUM, group, world)
    if fast:
        kept_mass = torch.exp(cand.to(torch.float64) - z_max.to(torch.float64).unsqueeze(1))
        kept_mass = torch.where(cand >= tau.unsqueeze(1), kept_mass * mult, torch.zeros_like(kept_mass)).sum(-1)
        sums[:, 0] = torch.where(p_on, kept_mass, sums[:, 0])
    return KeptSet(tau, (torch.log(sums[:, 0]) - torch.log(sums[:, 1])).to(acc), fast)


class SampledLogProbs(NamedTuple):
    """``log_prob``: the target's log-prob under the truncated, renormalised distribution (-inf where the target is
    outside the kept set); ``entropy``: over the kept set; ``log_kept_mass``: log S, the log of the kept set's mass
    under the untruncated ``softmax(logits / temperature)`` (<= 0); ``in_support``: whether the target is in the kept
    set (True at ignored positions). All ``[...]`` (the logits' leading shape), fp32 (fp64 for fp64 logits)."""

    log_prob: torch.Tensor
    entropy: torch.Tensor
    log_kept_mass: torch.Tensor
    in_support: torch.Tensor


def _capturing(t: torch.Tensor) -> bool:
    """Whether ``t``'s work would be recorded into a CUDA graph being captured on the current stream."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _refuse_capture(t: torch.Tensor, fn: str) -> None:
    """The replay reads per-row values on the host (parameter checks, the candidate width, whether a candidate list
    overflowed, the general search's rounds): inside a CUDA-graph capture those reads fail with an opaque CUDA
    error and spoil the capture. Refused up front instead, naming the call."""
    if _capturing(t):
        raise RuntimeError(f"{fn}: the sampling replay cannot be captured in a CUDA graph (it reads per-row values "
                           f"on the host between its passes; docs/sampling_replay.md, \"Cost\"): call it outside "
                           f"the captured region")


def _logits_entry(logits, target, ignore_index, tp_group, fn: str):
    """The checks of a logits entry point (dtype, shape, targets, ignore_index, no CUDA-graph capture) and its sizes:
    (ignore_index, world, rank, V_local, leading shape, rows)."""
    if not isinstance(logits, torch.Tensor) or logits.dtype not in _lp.FLOAT_DTYPES:
        raise TypeError(f"logits must be a float16/bfloat16/float32/float64 tensor, got "
                        f"{getattr(logits, 'dtype', type(logits))}")
    _refuse_capture(logits, fn)
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty last (vocab) dimension, got shape {tuple(logits.shape)}")
    _lp.check_target(target, logits, "logits")
    ignore_index = _lp.as_int("ignore_index", ignore_index)
    world, rank = _lp.group_size_rank(tp_group)
    lead = logits.shape[:-1]
    return ignore_index, world, rank, logits.shape[-1], lead, int(torch.Size(lead).numel())


def _check_targets(target1d: torch.Tensor, active: torch.Tensor, world: int, vocab_start: int, vocab_size: int,
                   local_vocab: int, fn: str) -> None:
    """What the plain log-prob kernels refuse, refused on every path of the replay (the candidate path never reaches
    them): a scored target outside ``[0, vocab_size)`` (it would come back as an out-of-support token and leave the
    loss silently) and, in one process, logits that do not hold the whole vocabulary."""
    _lp.check_single_shard(world, vocab_start, vocab_size, local_vocab, "the logits", "logits.shape[-1]")
    _refuse_out_of_vocab(target1d, active, vocab_size, fn)


def _refuse_out_of_vocab(target1d: torch.Tensor, active: torch.Tensor, vocab_size: int, fn: str) -> None:
    """A scored target outside ``[0, vocab_size)`` refused by name (one host read)."""
    bad = active & ((target1d < 0) | (target1d >= vocab_size))
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"{fn}: target holds an id outside [0, vocab_size={vocab_size}) that is not ignore_index: "
                         f"{int(target1d[i])} at flattened position {i}")


def _vocab_contiguous(logits2d: torch.Tensor) -> torch.Tensor:
    """Rows whose vocab dimension is unit-stride, as the kernels read them (and as vocab_parallel_log_probs takes
    logits): a transposed buffer is copied once (clone, not contiguous(): an empty view counts as contiguous whatever
    its strides); row-strided views stay views."""
    return logits2d if logits2d.stride(-1) == 1 else logits2d.clone(memory_format=torch.contiguous_format)


def _settings_fingerprint(*items) -> int:
    """A signed 64-bit fingerprint of a call's settings (numbers, None, dtypes, per-row tensors by value), the same
    in every process for the same settings: the ranks of a tensor-parallel group compare theirs."""
    h = hashlib.blake2b(digest_size=8)
    for x in items:
        if isinstance(x, torch.Tensor):
            x = x.detach().to("cpu", torch.float64 if x.is_floating_point() else torch.int64).contiguous()
            h.update(f"T{tuple(x.shape)}".encode() + x.numpy().tobytes())
        elif isinstance(x, bool) or x is None or isinstance(x, torch.dtype):
            h.update(repr(x).encode())
        elif isinstance(x, int):
            h.update(b"i" + struct.pack("<q", x))
        else:
            h.update(b"f" + struct.pack("<d", float(x)))
        h.update(b";")
    return int.from_bytes(h.digest(), "little", signed=True)


def _sampling_settings(sampling: "SamplingParams", *more) -> int:
    return _settings_fingerprint(sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, *more)


_SETTINGS_MISMATCH = ("the tensor-parallel ranks were given different settings (temperature, top_k, top_p, min_p, "
                      "the kept ids, ignore_index and the logits' dtype must agree across the group)")


def _refuse_non_finite(z_max: torch.Tensor, active: torch.Tensor, group, world: int, fn: str,
                       what: str = "logit in row {} of the flattened logits", row_id=None,
                       settings=None) -> torch.Tensor:
    """The all-reduce MAX of each row's max, raising on every rank alike when a scored row holds NaN or +inf on any
    shard (amax propagates NaN, which goes in as +inf: MAX keeps it, and no rank is left waiting in a collective
    another one skipped). ``what`` names the row (``row_id(i)``: the caller's row of row ``i``). ``settings()``:
    this rank's settings fingerprint, carried in the same MAX as its pieces and their negatives (equal on every
    rank exactly when MAX(pieces) = -MAX(-pieces)), so a rank given other settings fails every rank alike."""
    z_max = torch.where(torch.isnan(z_max), torch.full_like(z_max, math.inf), z_max)
    if world > 1 and settings is not None:
        pieces = _facts_encode([settings()], z_max.dtype, z_max.device)
        both = _all_reduce(torch.cat([z_max, pieces, -pieces]), dist.ReduceOp.MAX, group, world)
        n = z_max.shape[0]
        z_max, top, low = both[:n], both[n:n + _PIECES], both[n + _PIECES:]
        if not torch.equal(top, -low):
            raise ValueError(f"{fn}: {_SETTINGS_MISMATCH}")
    else:
        z_max = _all_reduce(z_max, dist.ReduceOp.MAX, group, world)
    bad = (z_max == math.inf) & active
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"{fn}: NaN or +inf {what.format(i if row_id is None else row_id(i))} (its target is not "
                         f"ignore_index){_OVERFLOW_HINT}")
    return z_max


#: z = logits / T in fp32 (fp64 for fp64 logits) overflows for finite logits past max * T: the sampler's
#: distribution is not defined there (vLLM divides its fp32 logits the same way), so such a row is refused too
_OVERFLOW_HINT = (", or a finite logit there whose quotient by the temperature is past the float range (|logit| / "
                  "temperature > the dtype's max; vLLM divides its fp32 logits the same way)")


#: shard facts each rank appends to the candidate path's all-gather: rows, vocab_start, local columns, columns below
#: vocab_size, vocab_size, the targets' fingerprint (as the log-prob records' headers carry them), and the settings'
#: fingerprint (temperature, top_k, top_p, min_p, ignore_index, the logits' dtype)
_LAYOUT_FACTS = 7
_PIECES = 4  # an int64 in four 16-bit pieces, each exact in fp32


def _facts_encode(values, dtype, device) -> torch.Tensor:
    return torch.tensor([((v & (2 ** 64 - 1)) >> (16 * j)) & 0xFFFF for v in values for j in range(_PIECES)],
                        dtype=dtype, device=device)


def _facts_decode(pieces: torch.Tensor) -> list:
    out = []
    for row in pieces.to(torch.int64).cpu().reshape(-1, _LAYOUT_FACTS, _PIECES).tolist():
        facts = [sum(p << (16 * j) for j, p in enumerate(v)) for v in row]
        out.append([f - 2 ** 64 if f >= 2 ** 63 else f for f in facts])
    return out


def sampled_log_probs(
    logits: torch.Tensor,
    target: torch.Tensor,
    sampling: SamplingParams,
    tp_group=None,
    *,
    vocab_start: Optional[int] = None,
    vocab_size: Optional[int] = None,
    ignore_index: int = -100,
) -> SampledLogProbs:
    """Log-probs of ``target`` under the distribution a vLLM-style sampler drew from with ``sampling``.

    ``logits``: this rank's vocab shard ``[..., V_local]`` (as :func:`vocab_parallel_log_probs`); ``target``: global
    ids ``[...]``. Differentiable in ``logits`` (log_prob and entropy; the kept set is piecewise constant, so the
    gradient is the renormalised softmax's over it and exactly 0 outside). A target outside the kept set has
    ``log_prob = -inf`` and ``in_support = False``: mask it out of any loss (the loss entry points that take a
    ``sampling`` do). Under ``tp_group`` every rank calls it with its shard; no rank holds more than its shard.
    """
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")  # before reading it
    ignore_index, world, rank, local_vocab, lead, n = _logits_entry(logits, target, ignore_index, tp_group,
                                                                    "sampled_log_probs")
    _check_entry(sampling, n, lead, tp_group, vocab_size, "these logits are")
    vocab_start, vocab_size = _lp.vocab_layout(vocab_start, vocab_size, rank, world, local_vocab)
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    logits2d = _vocab_contiguous(logits.reshape(n, local_vocab))
    target1d = target.reshape(n).to(torch.int64)  # int32 ids as the plain path takes them
    active = target1d != ignore_index  # ignored rows are never inspected (they may hold junk)
    _check_targets(target1d, active, world, vocab_start, vocab_size, local_vocab, "sampled_log_probs")
    _check_temperature(sampling.temperature, logits.dtype)
    temperature = _per_row("temperature", sampling.temperature, n, lead, acc, logits.device)
    temperature = torch.where(active, temperature, torch.ones_like(temperature))
    valid_cols = max(0, min(local_vocab, vocab_size - vocab_start))
    data = logits2d.detach()
    temp_col = temperature.unsqueeze(1)

    unit_t = not isinstance(sampling.temperature, torch.Tensor) and float(sampling.temperature) == 1.0
    all_active = bool(active.all())

    def z_of(r0, r1):
        """Rows r0:r1 of z = logits / temperature (vLLM divides its fp32 logits; in fp32 / fp64, or the logits'
        own bf16 / fp16 at temperature 1, which widen exactly); -inf at vocab padding; ignored rows read as 0 (never
        inspected). A view of the logits when nothing changes them."""
        z = data[r0:r1]  # at temperature 1, bf16 / fp16 logits stay as they are: the kernels widen them exactly
        view = unit_t
        if not unit_t:
            z = z.to(acc) / temp_col[r0:r1]
        if not all_active:
            z = torch.where(active[r0:r1].unsqueeze(1), z, torch.zeros((), dtype=z.dtype, device=z.device))
            view = False
        if valid_cols < local_vocab:  # vocab padding is not part of the distribution
            if view:  # z is a view of the caller's logits: copy first
                z = z.clone()
            z[:, valid_cols:] = -math.inf
        return z

    scalar_t = not isinstance(sampling.temperature, torch.Tensor)
    if scalar_t:  # top-k on every row: one read of the logits and a few candidates per row (None: not this case)
        res = _candidate_log_probs(logits2d, target1d, sampling, active, lead, n, tp_group, world, vocab_start,
                                   vocab_size, valid_cols, acc, ignore_index)
        if res is not None:
            return res
    with torch.no_grad():
        th = kept_set(z_of, n, local_vocab, acc, logits.device, sampling, active, lead, tp_group, world,
                      with_log_s=not scalar_t, extra_settings=(ignore_index, logits.dtype), vocab_size=vocab_size)
        tau = torch.where(active, th.threshold, torch.full_like(th.threshold, -math.inf))  # ignored rows: untouched
    if scalar_t:  # the kernels' own chunked path: no masked copy of the logits, log S from their row states
        logp, entropy, log_s = _FlooredLogProbs.apply(logits2d, target1d, tau.contiguous(), tp_group, world,
                                                      vocab_start, vocab_size, float(sampling.temperature),
                                                      ignore_index)
        log_s = torch.where(active, log_s, torch.zeros_like(log_s))
        in_support = (logp != -math.inf) | ~active
        return SampledLogProbs(logp.reshape(lead), entropy.reshape(lead), log_s.reshape(lead),
                               in_support.reshape(lead))
    # per-row temperatures: the kept set as a mask over z (the search's own chunks), the masked logits' log-probs
    below = torch.cat([~th.mask(z_of(r0, r1), r0) & active[r0:r1].unsqueeze(1)
                       for r0 in range(0, n, CHUNK_ROWS) for r1 in [min(r0 + CHUNK_ROWS, n)]]) if n else \
        torch.zeros((0, local_vocab), dtype=torch.bool, device=logits.device)
    log_s = torch.where(active, th.log_kept_mass, torch.zeros_like(th.log_kept_mass))
    return _masked_log_probs(logits2d, below, target1d, sampling.temperature, temperature, active, log_s, lead,
                             tp_group, vocab_start, vocab_size, ignore_index)


#: the largest top-k the candidate path takes (its exchange is ``k + slack`` values per row and rank); larger
#: ones take the general path
CANDIDATE_MAX_K = 1024


def _candidate_width(k_max: int) -> int:
    """Candidates kept per row and rank: k plus room for values tied with the k-th (bf16 logits tie often); a row
    with more ties than that takes the general path."""
    return k_max + max(16, k_max // 4)


def _candidate_log_probs(logits2d, target1d, sampling, active, lead, n, tp_group, world, vocab_start, vocab_size,
                         valid_cols, acc, ignore_index) -> Optional[SampledLogProbs]:
    """The replay when every scored row has a top-k (below the vocabulary) and the temperature is one number: each
    shard's values at or above its own k-th largest (``ops.row_candidates``: one read of the logits, which also
    gives the row max and sum of exps) hold every value the sampler could keep, since the global k-th largest is
    at least any shard's. One all-gather of those lists (and the row max, sum, the target's value) gives every rank
    the same candidates, on which top-k, min-p and top-p are decided exactly as on the whole row, and the
    kept set's log-probs, entropy and log S follow in fp64. Backward: the renormalised softmax's gradient on this
    shard's kept candidates, scattered into zeros (no collective). None when the case does not apply, or when a
    row has more values tied at its k-th largest than the lists hold (every rank sees the same, from the gather)."""
    if sampling.top_k is None or n == 0 or not bool(active.any()):
        return None
    k = _per_row("top_k", sampling.top_k, n, lead, torch.int64, logits2d.device)
    k_act = k[active]
    if not bool(((k_act > 0) & (k_act < vocab_size)).all()):
        return None  # a row without top-k (or one that keeps the whole vocabulary): the general path
    k_max = int(k_act.max())
    if k_max > CANDIDATE_MAX_K:
        return None
    width = _candidate_width(k_max)
    t_value = float(sampling.temperature)
    dev = logits2d.device
    ninf = -math.inf
    v_local = logits2d.shape[1]
    with torch.no_grad():
        tcol = target1d - vocab_start
        tcol = torch.where(active & (tcol >= 0) & (tcol < v_local), tcol, torch.full_like(tcol, -1))
        k_rows = torch.where(active, k, torch.zeros_like(k))
        vals, idx, count, stats = ops.row_candidates(logits2d.detach(), k_rows, tcol, width, t_value, valid_cols)
        vals = vals.to(acc)
        over = count > width
        if world > 1:  # one all-gather of [candidates, max, sum, target value, overflow] per row, in acc's dtype
            record = torch.cat([vals, stats.to(acc), over.to(acc).unsqueeze(1)], 1)
            # and, once per rank, the shard facts that the plain log-probs' record headers check (their rules)
            facts = [n, vocab_start, v_local, valid_cols, vocab_size, _fallback_lp.target_fingerprint(target1d),
                     _sampling_settings(sampling, ignore_index, logits2d.dtype)]
            flat = torch.cat([record.reshape(-1), _facts_encode(facts, acc, dev)])
            g = _lp.all_gather(flat, tp_group, world)
            headers = []
            all_facts = _facts_decode(g[:, n * (width + 4):])
            if any(f[-1] != all_facts[0][-1] for f in all_facts):
                raise ValueError("sampled_log_probs: " + _SETTINGS_MISMATCH)
            for f in all_facts:
                h = [0] * LY.HEADER_SLOTS
                h[LY.HDR_MAGIC] = LY.SHARD_MAGIC
                (h[LY.HDR_ROWS], h[LY.HDR_VOCAB_START], h[LY.HDR_LOCAL_VOCAB], h[LY.HDR_VALID_COLS],
                 h[LY.HDR_VOCAB_SIZE], h[LY.HDR_TARGET_HASH]) = f[:-1]
                headers.append(h)
            why = LY.layout_error(headers, vocab_size)
            if why is not None:
                raise ValueError("sampled_log_probs: the tensor-parallel shards do not fit together: " + why)
            g = g[:, :n * (width + 4)].reshape(world, n, width + 4)
            cand = g[:, :, :width].permute(1, 0, 2).reshape(n, world * width)  # the decision sorts each row
            z_max_r, sum_r, z_t_r, over_r = (g[:, :, width + j].t() for j in range(4))
        else:  # the kernel's lists are sorted already
            cand = vals
            z_max_r, sum_r, z_t_r, over_r = stats[:, 0:1], stats[:, 1:2], stats[:, 2:3], over.unsqueeze(1)
        # NaN: a NaN / +inf logit; +inf: a finite one whose quotient by the temperature overflowed (the row's kept
        # log-probs would read inf - inf)
        bad = (torch.isnan(z_max_r) | (z_max_r == math.inf)).any(1) & active
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"sampled_log_probs: NaN or +inf logit in row {i} of the flattened logits"
                             f"{_OVERFLOW_HINT}")
        z_max = z_max_r.amax(1).to(torch.float64)
        empty = (z_max == ninf) & active
        if bool(empty.any()):
            i = int(empty.nonzero()[0, 0])
            raise RuntimeError(f"every logit of row {i} (logits.reshape(-1, V_local)[{i}], over all tensor-parallel "
                               f"shards) is -inf: its softmax is undefined; give such positions target = "
                               f"ignore_index")
        if bool(over_r.any()):
            return None
        z_max = torch.where(active, z_max, torch.zeros_like(z_max))
        sum_all = (sum_r.to(torch.float64) * torch.exp(z_max_r.to(torch.float64) - z_max.unsqueeze(1))).sum(1)
        z_t = z_t_r.amax(1).to(torch.float64)
        # the thresholds and the kept set's log-probs (the rules: docs/sampling_replay.md), on every rank alike
        min_p = _per_row("min_p", sampling.min_p, n, lead, torch.float64, dev)
        floor = _min_p_floor(z_max, min_p, (min_p > 0) & active, acc)
        top_p = _per_row("top_p", sampling.top_p, n, lead, torch.float64, dev)
        tau, out = ops.candidate_decide(cand.contiguous(), z_max, z_t, sum_all, k_rows, floor, top_p)
        logp, entropy, log_s, log_kept = out.unbind(1)
        in_support = (logp != ninf) & active
    logp, entropy = _CandidateLogProbs.apply(logits2d, logp.to(acc), entropy.to(acc), vals, idx, tcol, tau, z_max,
                                             log_kept, entropy, in_support, 1.0 / t_value)
    return SampledLogProbs(logp.reshape(lead), entropy.reshape(lead), log_s.to(acc).reshape(lead),
                           (in_support | ~active).reshape(lead))


class _CandidateLogProbs(torch.autograd.Function):
    """(logits, the precomputed log-prob and entropy, this shard's candidates) -> (log-prob, entropy), with the kept
    set's softmax gradient: d logp / d z_u = [u = target] - p_u and d H / d z_u = -p_u (log p_u + H) on the kept
    candidates (z_u >= tau), p_u = exp((z_u - z_max) - log_kept) (relative to the row max: z_max + log_kept would
    round log_kept away for huge z), times 1 / T; 0 everywhere else (``ops.scatter_rows``)."""

    @staticmethod
    def forward(ctx, logits, logp, entropy, vals, idx, tcol, tau, z_max, log_kept, entropy64, in_support, inv_t):
        ctx.save_for_backward(vals, idx, tcol, tau, z_max, log_kept, entropy64, in_support, logits)
        ctx.info = (logits.shape[1], logits.dtype, inv_t)
        ctx.set_materialize_grads(False)
        return logp.clone(), entropy.clone()

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        vals, idx, tcol, tau, z_max, log_kept, entropy64, in_support, logits = ctx.saved_tensors
        cols, dtype, inv_t = ctx.info
        if grad_logp is None and grad_entropy is None:
            return (None,) * 12
        with torch.no_grad():
            kept = (vals >= tau.unsqueeze(1)) & (vals != -math.inf) & (idx >= 0)
            lp_u = torch.where(kept, (vals.to(torch.float64) - z_max.unsqueeze(1)) - log_kept.unsqueeze(1),
                               torch.zeros((), dtype=torch.float64, device=vals.device))
            p = torch.where(kept, lp_u.exp(), torch.zeros_like(lp_u))
            g = torch.zeros_like(p)
            if grad_logp is not None:  # a target outside the kept set (log-prob -inf) has no gradient
                gl = torch.where(in_support, grad_logp, torch.zeros_like(grad_logp)).to(torch.float64)
                is_t = (kept & (idx == tcol.unsqueeze(1))).to(torch.float64)
                g = g + gl.unsqueeze(1) * (is_t - p)
            if grad_entropy is not None:
                g = g - grad_entropy.to(torch.float64).unsqueeze(1) * p * (lp_u + entropy64.unsqueeze(1))
            g = (g * inv_t).to(torch.float64 if dtype == torch.float64 else torch.float32)
            grad = ops.scatter_rows(g, torch.where(kept, idx, torch.full_like(idx, -1)), cols, dtype)
        if torch.is_grad_enabled():  # create_graph=True: differentiating this gradient again must raise
            anchors = [t for t in (logits, grad_logp, grad_entropy) if t is not None and t.requires_grad]
            if anchors:
                grad = ops.NoDoubleBackward.apply(grad, "sampled_log_probs", *anchors)
        return (grad,) + (None,) * 11


#: rows per chunk of the floored forward and backward (a chunk-sized masked temporary, never [N, V])
FLOOR_CHUNK_ROWS = 64


class _FlooredLogProbs(torch.autograd.Function):
    """(logits [N, V_local], target [N], floor [N]) -> (logp, entropy, log S), each [N]: the
    log-probs of softmax(logits / T) renormalised over ``{u: logits_u / T >= floor}`` (T one number) through the
    log-prob family's own ops, without a masked copy of the logits: each ``FLOOR_CHUNK_ROWS``-row chunk is masked in
    a temporary, folded into its shard record and dropped; the unmasked logits give one more record (log S =
    lse(kept) - lse(all) from the two merges' row states, and every error names the caller's row); one all-gather
    carries them all. Backward: the log-prob kernel's gradient with the kept set's row states, then the columns
    outside the kept set zeroed."""

    @staticmethod
    def forward(ctx, logits, target, floor, tp_group, world, vocab_start, vocab_size, t_value, ignore_index):
        inv_t = _lp.checked_inv_temperature(t_value, logits.dtype)
        n = logits.shape[0]
        chunks = [(r0, min(r0 + FLOOR_CHUNK_ROWS, n)) for r0 in range(0, n, FLOOR_CHUNK_ROWS)]
        records = [ops.vocab_row_stats(logits, target, vocab_start, vocab_size, inv_t, ignore_index, False, False)]
        # one chunk buffer, reused: a fresh chunk-sized allocation per chunk would churn through the heap
        buf = logits.new_empty((min(FLOOR_CHUNK_ROWS, n), logits.shape[1]))
        for r0, r1 in chunks:
            z = buf[:r1 - r0]
            ops.floor_fill(logits[r0:r1], floor[r0:r1], t_value, z)
            records.append(ops.vocab_row_stats(z, target[r0:r1], vocab_start, vocab_size, inv_t, ignore_index,
                                               False, True))
        del buf
        lengths = [r.numel() for r in records]
        flat = torch.cat(records)
        gathered = _lp.all_gather(flat, tp_group, world) if world > 1 else flat.unsqueeze(0)
        cuda = logits.device.type == "cuda"
        _, _, _, state_all, status = ops.merge_row_stats(gathered[:, :lengths[0]].contiguous(), target,
                                                         ignore_index, vocab_size, inv_t, False)
        if cuda:
            _lp.assert_status(status)
        logps, entropies, states = [], [], []
        offset = lengths[0]
        for (r0, r1), length in zip(chunks, lengths[1:]):
            logp, entropy, _, state, status = ops.merge_row_stats(
                gathered[:, offset:offset + length].contiguous(), target[r0:r1], ignore_index, vocab_size, inv_t,
                False)
            if cuda:
                _lp.assert_status(status)
            offset += length
            logps.append(logp)
            entropies.append(entropy)
            states.append(state)
        empty = logits.new_zeros((0,), dtype=state_all.dtype)
        logp = torch.cat(logps) if logps else empty
        entropy = torch.cat(entropies) if entropies else empty
        row_state = torch.cat(states) if states else state_all
        mx, lse = LY.ROW_STATE_MAX, LY.ROW_STATE_LOG_SUM_EXP
        log_s = (row_state[:, mx] - state_all[:, mx]) * inv_t + (row_state[:, lse] - state_all[:, lse])
        outside = logp == -math.inf  # a target under the floor: no gradient flows from it
        ctx.save_for_backward(logits, target, floor, row_state, outside)
        ctx.args = (vocab_start, vocab_size, t_value, inv_t, ignore_index)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(log_s)
        return logp, entropy, log_s

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, grad_log_s):
        logits, target, floor, row_state, outside = ctx.saved_tensors
        vocab_start, vocab_size, t_value, inv_t, ignore_index = ctx.args
        if grad_logp is None and grad_entropy is None:
            return (None,) * 9
        with torch.no_grad():
            if grad_logp is not None:
                grad_logp = grad_logp.masked_fill(outside, 0.0)
            # The kept set's softmax gradient on the unmasked logits (the row states are the kept set's, and every
            # column under the floor holds a smaller logit than any kept one: finite there), then those columns
            # zeroed. The out-of-place kernel writes into the CPU kernels' reused gradient block.
            grad = ops.logprob_backward(grad_logp, grad_entropy, None, logits, target, row_state, vocab_start,
                                        vocab_size, inv_t, ignore_index)
            ops.floor_zero_(grad, logits, floor, t_value)
        if torch.is_grad_enabled():  # create_graph=True: differentiating this gradient again must raise
            anchors = [t for t in (logits, grad_logp, grad_entropy) if t is not None and t.requires_grad]
            if anchors:
                grad = ops.NoDoubleBackward.apply(grad, "sampled_log_probs", *anchors)
        return (grad,) + (None,) * 8


def _masked_log_probs(logits2d, below, target1d, temperature_spec, temperature, active, log_s, lead, tp_group,
                      vocab_start, vocab_size, ignore_index) -> SampledLogProbs:
    """The outputs both modes share: the plain vocab-parallel log-probs (and entropy) of the logits with the
    columns outside each row's kept set (``below``) at -inf, through the existing kernels (their gradient is the
    renormalised softmax's over the kept set and exactly 0 outside)."""
    masked = logits2d.masked_fill(below, -math.inf)
    scalar_t = temperature_spec if not isinstance(temperature_spec, torch.Tensor) else None
    if scalar_t is None:  # per-row temperatures: scale here, the kernel then runs at temperature 1
        masked = masked.to(temperature.dtype) / temperature.unsqueeze(1)
        scalar_t = 1.0
    logp, entropy = _lp.vocab_parallel_log_probs(masked, target1d, tp_group, vocab_start=vocab_start,
                                                 vocab_size=vocab_size, temperature=scalar_t,
                                                 ignore_index=ignore_index, return_entropy=True)
    # a target outside the kept set has no gradient (the kernel's would be -p on the kept columns): its -inf
    # log-prob is passed on detached, the same values
    outside = logp == -math.inf
    logp = torch.where(outside, logp.detach(), logp)
    in_support = ~outside | ~active
    return SampledLogProbs(logp.reshape(lead), entropy.reshape(lead), log_s.reshape(lead), in_support.reshape(lead))


@dataclasses.dataclass(frozen=True)
class KeptTokens:
    """The token ids an engine reports it kept for each position (its sampler's support), as a ragged CSR list:
    row ``i`` kept ``ids[offsets[i]:offsets[i + 1]]`` (global vocabulary ids, any order, no repeats). Rows are the
    flattened positions of the log-probs' target (row-major over its shape; a packed stream: its order).
    ``temperature``: what the engine divided its logits by (a number or one value per row), as in
    :class:`SamplingParams`. Checked when built (offsets ``[N + 1]`` from 0, non-decreasing, ending at
    ``ids.numel()``; ids >= 0); the ids are checked against the vocabulary, for repeats and for empty kept sets at
    scored rows when used. :meth:`from_lists` builds one from Python lists."""

    ids: torch.Tensor
    offsets: torch.Tensor
    temperature: Union[Number, torch.Tensor] = 1.0
    #: for error messages only (set by :meth:`permute_rows`): the caller's row of each row and the caller's index of
    #: each id, so that an error names what the caller built, not the reordered copy
    source_rows: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False, compare=False)
    source_ids: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False, compare=False)

    def caller_row(self, i: int) -> int:
        return i if self.source_rows is None else int(self.source_rows[i])

    def caller_id_index(self, j: int) -> int:
        return j if self.source_ids is None else int(self.source_ids[j])

    def __post_init__(self):
        for name in ("ids", "offsets"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype.is_floating_point or t.is_complex() \
                    or t.dtype == torch.bool:
                raise TypeError(f"KeptTokens.{name} must be a 1-D integer tensor, got "
                                f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        off = self.offsets
        if off.numel() == 0:
            raise ValueError("KeptTokens.offsets must hold N + 1 entries (at least [0]), got an empty tensor")
        if off.device != self.ids.device:
            raise ValueError(f"KeptTokens.ids ({self.ids.device}) and offsets ({off.device}) must be on one device")
        o = off.to(torch.int64)
        if int(o[0]) != 0 or int(o[-1]) != self.ids.numel() or bool((o[1:] < o[:-1]).any()):
            raise ValueError(f"KeptTokens.offsets must start at 0, never decrease and end at ids.numel() = "
                             f"{self.ids.numel()}, got {o.tolist() if o.numel() <= 8 else o}")
        if self.ids.numel() and int(self.ids.min()) < 0:
            raise ValueError(f"KeptTokens.ids must be >= 0 (global token ids), got {int(self.ids.min())}")
        try:  # the same check as the sampler's parameters, naming this class's field
            SamplingParams(temperature=self.temperature)
        except (TypeError, ValueError) as e:
            raise type(e)(str(e).replace("SamplingParams.", "KeptTokens.")) from None

    @classmethod
    def from_lists(cls, kept, temperature: Union[Number, torch.Tensor] = 1.0, device=None) -> "KeptTokens":
        """From one list of kept ids per row (e.g. the ids of an engine's returned top-logprobs / support)."""
        counts = [len(r) for r in kept]
        offsets = torch.tensor([0] + counts, dtype=torch.int64).cumsum(0)
        ids = torch.tensor([int(i) for r in kept for i in r], dtype=torch.int64)
        return cls(ids.to(device), offsets.to(device), temperature)

    @property
    def rows(self) -> int:
        return self.offsets.numel() - 1

    def permute_rows(self, order: torch.Tensor) -> "KeptTokens":
        """The kept sets of rows ``order`` (new row ``j`` is old row ``order[j]``), e.g. for a transposed layout."""
        off = self.offsets.to(torch.int64)
        order = order.to(off.device, torch.int64)
        counts = (off[1:] - off[:-1])[order]
        starts = off[:-1][order]
        new_off = torch.cat([off.new_zeros(1), counts.cumsum(0)])
        pos = torch.arange(int(new_off[-1]), device=off.device) - torch.repeat_interleave(new_off[:-1], counts) + \
            torch.repeat_interleave(starts, counts)
        t = self.temperature
        if isinstance(t, torch.Tensor) and t.dim():
            t = t.reshape(-1)[order.to(t.device)]
        rows = order if self.source_rows is None else self.source_rows.to(order.device)[order]
        ids = pos if self.source_ids is None else self.source_ids.to(pos.device)[pos]
        return KeptTokens(self.ids[pos], new_off.to(self.offsets.dtype), t, rows, ids)


def _kept_entries(kept: "KeptTokens", n: int, active: torch.Tensor, vocab_start: int, vocab_size: int,
                  valid_cols: int, device):
    """``kept`` on ``device``, checked against the scored rows ``active``: ``(offsets, ids, counts, row, local)``,
    int64, with ``row`` the row of each kept id and ``local`` whether this shard's columns ``[vocab_start,
    vocab_start + valid_cols)`` hold it (and its row is scored). Every scored row keeps at least one id, inside the
    vocabulary, none twice (host checks, as for the targets)."""
    off = kept.offsets.to(device=device, dtype=torch.int64)
    ids = kept.ids.to(device=device, dtype=torch.int64)
    counts = off[1:] - off[:-1]
    row = torch.repeat_interleave(torch.arange(n, device=device), counts, output_size=ids.numel())
    if ids.numel() and int(ids.max()) >= vocab_size:
        bad = int((ids >= vocab_size).nonzero()[0, 0])
        raise ValueError(f"kept.ids[{kept.caller_id_index(bad)}] = {int(ids[bad])} (row "
                         f"{kept.caller_row(int(row[bad]))}) is outside the vocabulary of {vocab_size}")
    empty = active & (counts == 0)
    if bool(empty.any()):
        raise ValueError(f"kept: row {kept.caller_row(int(empty.nonzero()[0, 0]))} is scored (its target is not "
                         f"ignore_index) but has no kept ids; an engine always keeps at least its top token")
    if ids.numel():
        key, _ = (row * vocab_size + ids).sort()
        rep = key[1:] == key[:-1]
        if bool(rep.any()):
            k = int(key[1:][rep][0])
            raise ValueError(f"kept: row {kept.caller_row(k // vocab_size)} lists id {k % vocab_size} twice (its "
                             f"mass would count twice)")
    local = (ids >= vocab_start) & (ids < vocab_start + valid_cols) & active[row]
    return off, ids, counts, row, local


def _refuse_torn_or_dead(fn: str, kept: "KeptTokens", active: torch.Tensor, held: torch.Tensor,
                         counts: torch.Tensor, dead: torch.Tensor) -> None:
    """The kept-set checks after the collectives: every scored row's kept ids held by exactly one shard (``held``,
    summed over the ranks, equal to ``counts``), and not all of them at -inf (``dead``)."""
    torn = active & (held != counts.to(torch.float64))
    if bool(torn.any()):
        i = int(torn.nonzero()[0, 0])
        raise ValueError(f"{fn}: the tensor-parallel shards hold {int(held[i])} of row {i}'s {int(counts[i])} kept "
                         f"ids (each must be on exactly one shard): the vocab ranges overlap or leave gaps (check "
                         f"vocab_start / vocab_size)")
    dead = active & dead
    if bool(dead.any()):
        raise ValueError(f"kept: every kept id of row {kept.caller_row(int(dead.nonzero()[0, 0]))} has a -inf "
                         f"logit here, so the distribution renormalised over them is undefined (the engine kept "
                         f"tokens this model gives probability 0: a different vocabulary mask?); give such "
                         f"positions target = ignore_index")


def kept_log_probs(
    logits: torch.Tensor,
    target: torch.Tensor,
    kept: KeptTokens,
    tp_group=None,
    *,
    vocab_start: Optional[int] = None,
    vocab_size: Optional[int] = None,
    ignore_index: int = -100,
) -> SampledLogProbs:
    """:func:`sampled_log_probs` over the kept sets an engine reported (``kept``, a :class:`KeptTokens`) instead of
    thresholds replayed from sampling parameters: the target's log-prob under ``softmax(logits / T)`` renormalised
    over exactly those ids (-inf and ``in_support = False`` when the target is not among them), the entropy over
    them, and log S, their mass under the untruncated distribution. Under ``tp_group`` every rank passes the same
    ``kept`` (global ids) and its own vocab shard; no rank holds more than its shard (log S: one all-reduce MAX of two
    numbers and one all-reduce SUM of four per row, besides the log-probs' own collective). Differentiable in ``logits``
    (the renormalised softmax's gradient over the kept ids, exactly 0 elsewhere)."""
    if not isinstance(kept, KeptTokens):
        raise TypeError(f"kept must be a KeptTokens, got {type(kept).__name__}")
    ignore_index, world, rank, local_vocab, lead, n = _logits_entry(logits, target, ignore_index, tp_group,
                                                                    "kept_log_probs")
    if kept.rows != n:
        raise ValueError(f"kept has {kept.rows} rows (offsets of {kept.offsets.numel()} entries), but the logits have "
                         f"{n} = {tuple(lead)} positions")
    if tp_group is None and vocab_size is None and _lp.megatron_tp_size() > 1:
        _check_entry(SamplingParams(), n, lead, tp_group, vocab_size, "these logits are")
    vocab_start, vocab_size = _lp.vocab_layout(vocab_start, vocab_size, rank, world, local_vocab)
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    device = logits.device
    _check_temperature(kept.temperature, logits.dtype)
    temperature = _per_row("temperature", kept.temperature, n, lead, acc, device)
    logits2d = _vocab_contiguous(logits.reshape(n, local_vocab))
    target1d = target.reshape(n).to(torch.int64)
    active = target1d != ignore_index
    _check_targets(target1d, active, world, vocab_start, vocab_size, local_vocab, "kept_log_probs")
    temperature = torch.where(active, temperature, torch.ones_like(temperature))
    valid_cols = max(0, min(local_vocab, vocab_size - vocab_start))
    off, ids, counts, row, local = _kept_entries(kept, n, active, vocab_start, vocab_size, valid_cols, device)
    below = torch.ones((n, local_vocab), dtype=torch.bool, device=device)
    below[row[local], ids[local] - vocab_start] = False
    below &= active.unsqueeze(1)  # ignored rows: untouched (never inspected)

    with torch.no_grad():  # log S = log(kept mass) - log(total mass), relative to the row max of z = logits / T
        z_max = torch.full((n,), -math.inf, dtype=acc, device=device)
        for r0 in range(0, n, CHUNK_ROWS):
            r1 = min(r0 + CHUNK_ROWS, n)
            z = logits2d[r0:r1, :valid_cols].detach().to(acc) / temperature[r0:r1].unsqueeze(1)
            z_max[r0:r1] = torch.where(active[r0:r1], z.amax(-1) if valid_cols else z_max[r0:r1], 0.0)
        zk = logits2d.detach()[row[local], ids[local] - vocab_start].to(acc) / temperature[row[local]]
        # the kept ids' own max too (in the same MAX): their mass relative to it cannot underflow, where relative to
        # the row max it does once they all lie ~745 nats below it
        kept_max = torch.full((n,), -math.inf, dtype=acc, device=device).scatter_reduce(0, row[local], zk, "amax")
        # NaN / +inf anywhere in a scored row (kept id or not) would poison log S's total: refused on every rank by
        # the row max (a kept id lies in its row, so the kept max needs no refusal of its own, only the MAX)
        maxes = _refuse_non_finite(torch.cat([z_max, kept_max]), torch.cat([active, torch.zeros_like(active)]),
                                   tp_group, world, "kept_log_probs",
                                   row_id=lambda i: i % max(n, 1), settings=lambda: (
            _settings_fingerprint(kept.temperature, ignore_index, logits.dtype, _fallback_lp.target_fingerprint(off),
                                  _fallback_lp.target_fingerprint(ids))))
        z_max, kept_max = maxes[:n], maxes[n:]
        finite_max = torch.where(torch.isfinite(z_max), z_max, torch.zeros_like(z_max))
        finite_kept = torch.where(torch.isfinite(kept_max), kept_max, torch.zeros_like(kept_max))
        # kept mass, total mass, finite kept ids, kept ids this shard holds (over the ranks: each id once, exactly
        # when the shards tile the vocabulary)
        sums = torch.zeros((n, 4), dtype=torch.float64, device=device)
        for r0 in range(0, n, CHUNK_ROWS):
            r1 = min(r0 + CHUNK_ROWS, n)
            z = logits2d[r0:r1, :valid_cols].detach().to(acc) / temperature[r0:r1].unsqueeze(1)
            e = torch.exp(z - finite_max[r0:r1].unsqueeze(1))
            sums[r0:r1, 1] = torch.where(active[r0:r1], row_sums(e).double(), 0.0)
        sums[:, 0].index_add_(0, row[local], torch.exp(zk.double() - finite_kept[row[local]].double()))
        sums[:, 2].index_add_(0, row[local], (zk != -math.inf).double())
        sums[:, 3].index_add_(0, row[local], torch.ones_like(zk, dtype=torch.float64))
        sums = _all_reduce(sums, dist.ReduceOp.SUM, tp_group, world)
        _refuse_torn_or_dead("kept_log_probs", kept, active, sums[:, 3], counts, sums[:, 2] == 0)
        log_s = (finite_kept.double() - finite_max.double()) + torch.log(sums[:, 0]) - torch.log(sums[:, 1])
        # at most 0: a kept set of (nearly) every id reaches the total but for the rounding of the sums
        log_s = torch.where(active, log_s.clamp(max=0.0).to(acc), 0.0)
    return _masked_log_probs(logits2d, below, target1d, kept.temperature, temperature, active, log_s, lead,
                             tp_group, vocab_start, vocab_size, ignore_index)


#: Kept ids per block of the hidden-state kept-set path: each block gathers this many ``[H]`` rows of ``hidden``
#: and of ``weight`` (forward, and again in backward), so its temporaries stay bounded whatever the kept sets hold.
KEPT_BLOCK = 4096


def _kept_blocks(m: int):
    return [(e0, min(e0 + KEPT_BLOCK, m)) for e0 in range(0, m, KEPT_BLOCK)]


def _kept_logits(h, w, b, row, col, e0, e1, acc, inv_t, overflow=None):
    """z of the kept entries e0:e1: ``(hidden[row] . weight[col] + bias[col]) / T`` in ``acc``. ``overflow``: a
    [e1 - e0] bool tensor set where a finite logit's z is not (its quotient by T is past acc's range)."""
    z = (h[row[e0:e1]].to(acc) * w[col[e0:e1]].to(acc)).sum(-1)
    if b is not None:
        z = z + b[col[e0:e1]].to(acc)
    zs = z * inv_t
    if overflow is not None:
        torch.logical_and(torch.isfinite(z), torch.isinf(zs), out=overflow)
    return zs


class _KeptLinear(torch.autograd.Function):
    """(hidden2d [N, H], weight [V_local, H], bias or None) -> (log-prob [N], entropy [N]) over each row's kept ids
    (``row``, ``col``: the row and local column of every kept id this shard holds; ``is_t``: whether it is its row's
    target). Forward: the kept logits block by block, all-reduces of one MAX, 5 sums and one id per row; backward:
    the renormalised softmax's gradient on the kept logits, into the rows of hidden and weight they came from (no
    collective: ``grad_hidden`` is this shard's part, as :func:`rollout_corr_ext.linear_log_probs`'). ``sp``
    (sequence parallelism): ``hidden`` is this rank's piece of the rows and ``gathered`` the whole (detached); only
    the piece is kept for backward, which gathers it again and reduce-scatters ``grad_hidden`` (megatron's output
    layer under sequence parallelism: the gradient of this rank's rows, summed over the shards)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, row, col, is_t, active, inv_t, tp_group, world, vocab_start, sp=False,
                gathered=None):
        local = hidden
        if sp:
            hidden = gathered
        n, acc = hidden.shape[0], (torch.float64 if hidden.dtype == torch.float64 else torch.float32)
        dev, m = hidden.device, row.numel()
        z = torch.empty(m, dtype=acc, device=dev)
        over = torch.empty(m, dtype=torch.bool, device=dev)
        for e0, e1 in _kept_blocks(m):
            z[e0:e1] = _kept_logits(hidden, weight, bias, row, col, e0, e1, acc, inv_t, over[e0:e1])
        z_max = torch.full((n,), -math.inf, dtype=acc, device=dev).scatter_reduce(0, row, z, "amax")
        z_max = _all_reduce(z_max, dist.ReduceOp.MAX, tp_group, world)
        base = torch.where(torch.isfinite(z_max), z_max, torch.zeros_like(z_max)).double()
        # every quantity relative to the kept max (base + log_kept would round log_kept away for huge z)
        rel = z.double() - base[row]
        e = torch.exp(rel)
        # mass, mass * (z - base), the target's z - base, the target held, kept ids held (over the ranks: each id
        # once), kept ids whose finite logit overflowed when divided by T (refused by the caller, on every rank)
        sums = torch.zeros((n, 6), dtype=torch.float64, device=dev)
        sums[:, 0].index_add_(0, row, e)
        sums[:, 1].index_add_(0, row, torch.where(e > 0, e * rel, 0.0))
        sums[:, 2].index_add_(0, row, torch.where(is_t, rel, 0.0))
        sums[:, 3].index_add_(0, row, is_t.double())
        sums[:, 4].index_add_(0, row, torch.ones_like(e))
        sums[:, 5].index_add_(0, row, over.double())
        sums = _all_reduce(sums, dist.ReduceOp.SUM, tp_group, world)
        log_kept = torch.log(sums[:, 0])
        logp = torch.where(active & (sums[:, 3] > 0), sums[:, 2] - log_kept, -math.inf)
        entropy = torch.where(active, log_kept - sums[:, 1] / sums[:, 0], 0.0)
        logp = torch.where(active, logp, 0.0)
        ctx.save_for_backward(local, weight, bias, row, col, is_t, base, log_kept, entropy, logp != -math.inf)
        ctx.inv_t, ctx.acc = inv_t, acc
        ctx.sp = (tp_group, world) if sp else None
        # the largest id among those at the kept max (over the ranks), whose untruncated log-prob gives log S
        top = torch.where(z == z_max[row], col + vocab_start, -1)
        ref = torch.full((n,), -1, dtype=torch.int64, device=dev).scatter_reduce(0, row, top, "amax")
        ref = _all_reduce(ref, dist.ReduceOp.MAX, tp_group, world)
        # the kept logsumexp relative to the kept max, the kept max (fp64), the kept ids held, the reference id, the
        # overflowed kept logits
        stats = torch.stack([log_kept, base, sums[:, 4], ref.double(), sums[:, 5]], 1)
        ctx.mark_non_differentiable(stats)
        return logp.to(acc), entropy.to(acc), stats

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, _):
        hidden, weight, bias, row, col, is_t, base, log_kept, entropy, finite = ctx.saved_tensors
        with torch.no_grad():
            from .linear import gather_sequence

            full = hidden if ctx.sp is None else gather_sequence(hidden, *ctx.sp)
            grads = _KeptLinear._grads(ctx, full, weight, bias, row, col, is_t, base, log_kept, entropy, finite,
                                       grad_logp, grad_entropy)
            del full
        if torch.is_grad_enabled():  # create_graph=True: differentiating this gradient again must raise
            anchors = [t for t in (hidden, weight, bias, grad_logp, grad_entropy) if t is not None and t.requires_grad]
            if anchors:
                grads = [None if g is None else ops.NoDoubleBackward.apply(g, "kept_linear_log_probs", *anchors)
                         for g in grads]
        return tuple(grads) + (None,) * 10

    @staticmethod
    def _grads(ctx, hidden, weight, bias, row, col, is_t, base, log_kept, entropy, finite, grad_logp, grad_entropy):
        acc, inv_t = ctx.acc, ctx.inv_t
        # a target outside the kept set (-inf) passes no gradient; the entropy's flows in every scored row
        g_lp = torch.where(finite, grad_logp.double(), 0.0)
        g_ent = grad_entropy.double()
        grad_h = torch.zeros(hidden.shape, dtype=acc, device=hidden.device) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        grad_b = (torch.zeros(bias.shape, dtype=acc, device=bias.device)
                  if bias is not None and ctx.needs_input_grad[2] else None)
        for e0, e1 in _kept_blocks(row.numel()):
            r, c = row[e0:e1], col[e0:e1]
            z_i = _kept_logits(hidden, weight, bias, row, col, e0, e1, acc, inv_t).double()
            logp_i = (z_i - base[r]) - log_kept[r]
            p = torch.exp(logp_i)
            # d log p_t / dz_i = [i = t] - p_i; d H / dz_i = -p_i (log p_i + H)
            gz = g_lp[r] * (is_t[e0:e1].double() - p) - g_ent[r] * torch.where(p > 0, p * (logp_i + entropy[r]), 0.0)
            gz = (gz * inv_t).to(acc)
            if grad_h is not None:
                grad_h.index_add_(0, r, gz.unsqueeze(1) * weight[c].to(acc))
            if grad_w is not None:
                grad_w.index_add_(0, c, gz.unsqueeze(1) * hidden[r].to(acc))
            if grad_b is not None:
                grad_b.index_add_(0, c, gz)
        if grad_h is not None and ctx.sp is not None:  # this rank's rows, summed over the shards (in acc)
            from .linear import reduce_scatter_sequence

            grad_h = reduce_scatter_sequence(grad_h, *ctx.sp)
        cast = lambda g, like: None if g is None else g.to(like.dtype)  # noqa: E731
        return [cast(grad_h, hidden), cast(grad_w, weight), cast(grad_b, bias)]


def kept_linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    kept: "KeptTokens",
    tp_group=None,
    *,
    bias: Optional[torch.Tensor] = None,
    vocab_start: Optional[int] = None,
    vocab_size: Optional[int] = None,
    ignore_index: int = -100,
    chunk_rows: Optional[int] = None,
    chunk_cols: Optional[int] = None,
    check_group: Optional[bool] = None,
    sequence_parallel: bool = False,
) -> SampledLogProbs:
    """:func:`kept_log_probs` of the logits ``hidden @ weight.T + bias`` without the ``[N, V_local]`` logits tensor:
    the log-prob and the entropy come from the kept ids' logits alone (each a dot product of a row of ``hidden``
    with a row of ``weight``, gathered :data:`KEPT_BLOCK` at a time), and log S from one untruncated
    :func:`rollout_corr_ext.linear_log_probs` pass (no gradient; ``chunk_rows`` / ``chunk_cols`` / ``check_group``
    are its). Differentiable in ``hidden``, ``weight`` and ``bias`` (the renormalised softmax's gradient over the
    kept ids, exactly 0 on every other row of ``weight``); the temperature must be one number here. Under
    ``tp_group`` every rank passes the same ``kept`` (global ids) and its own shard of ``weight``: all-reduces of one
    MAX, five sums and one id per row besides the log-S pass's own collective, none in backward; ``grad_hidden`` is
    this shard's part, as :func:`rollout_corr_ext.linear_log_probs`'. ``sequence_parallel``: as there (``hidden`` is
    this rank's ``[s / tp, ..., H]`` piece of the sequence, ``target`` and ``kept`` the whole sequence's; the piece is
    gathered once for the kept logits and the log-S pass, gathered again in backward, and ``grad_hidden`` is this
    rank's rows' gradient summed over the shards: one reduce-scatter). Its sums and
    gradient scatters are torch's ``index_add_``, whose CUDA form adds with atomics: on a GPU the last bits of the
    entropy, log S and the gradients can differ run to run (the compiled kernels of the other entry points do not)."""
    from . import linear as _linear

    if not isinstance(kept, KeptTokens):
        raise TypeError(f"kept must be a KeptTokens, got {type(kept).__name__}")
    if isinstance(kept.temperature, torch.Tensor):
        raise ValueError("kept_linear_log_probs: KeptTokens.temperature must be one number (per-row temperatures: "
                         "compute the logits and use kept_log_probs)")
    if isinstance(hidden, torch.Tensor):
        _refuse_capture(hidden, "kept_linear_log_probs")
    a = _linear.prepare(hidden, weight, target, tp_group, bias, vocab_start, vocab_size, kept.temperature,
                         ignore_index, chunk_rows, chunk_cols, check_group, sequence_parallel)
    n, v_local, device = a.target1d.numel(), weight.shape[0], hidden.device
    if kept.rows != n:
        raise ValueError(f"kept has {kept.rows} rows (offsets of {kept.offsets.numel()} entries), but "
                         f"{'the gathered hidden' if a.sequence_parallel else 'hidden'} has {n} = {tuple(a.lead)} "
                         f"positions")
    # sequence parallel: the whole sequence's rows, gathered once (detached) for the kept logits and the log-S pass
    whole = _linear.gather_sequence(a.hidden2d.detach(), tp_group, a.world) if a.sequence_parallel else None
    active = a.target1d != a.ignore_index
    # a scored target outside the vocabulary: refused below, in the host read the NaN check makes anyway
    bad_target = active & ((a.target1d < 0) | (a.target1d >= a.vocab_size))
    valid_cols = max(0, min(v_local, a.vocab_size - a.vocab_start))
    _, ids, counts, row, local = _kept_entries(kept, n, active, a.vocab_start, a.vocab_size, valid_cols, device)
    row_l, col_l = row[local], ids[local] - a.vocab_start
    is_t = ids[local] == a.target1d[row_l]
    logp, entropy, stats = _KeptLinear.apply(a.hidden2d, weight, bias, row_l, col_l, is_t, active, a.inv_temp,
                                             tp_group, a.world, a.vocab_start, a.sequence_parallel, whole)
    with torch.no_grad():
        bad = active & (torch.isnan(stats[:, 0]) | (stats[:, 0] == math.inf) | (stats[:, 4] > 0))
        if bool((bad | bad_target).any()):
            _refuse_out_of_vocab(a.target1d, active, a.vocab_size, "kept_linear_log_probs")
            i = int(bad.nonzero()[0, 0])
            raise ValueError(f"kept_linear_log_probs: NaN or +inf logit of a kept id in row {i} of the flattened "
                             f"hidden states (hidden, weight or bias holds NaN / inf there, or the product overflows "
                             f"{hidden.dtype}){_OVERFLOW_HINT}; rows whose target is ignore_index are exempt")
        _refuse_torn_or_dead("kept_linear_log_probs", kept, active, stats[:, 2], counts, ~torch.isfinite(stats[:, 0]))
        # log S = logsumexp over the kept ids - logsumexp over the vocabulary, the latter z* - log p(*) of the
        # untruncated pass at the kept max's id * (its log-prob is the largest of the kept ones: the least rounding;
        # the pass refuses NaN / +inf logits in a scored row, on every rank): log_kept + log p(*), at most 0 (a kept
        # set of the whole vocabulary sums to the total but for rounding)
        ref = torch.where(active, stats[:, 3].to(torch.int64), a.ignore_index)
        rows_in = a.hidden2d.detach() if whole is None else whole
        full = _linear.linear_log_probs(rows_in, weight.detach(), ref, tp_group,
                                        bias=None if bias is None else bias.detach(), vocab_start=a.vocab_start,
                                        vocab_size=a.vocab_size, temperature=kept.temperature,
                                        ignore_index=a.ignore_index, chunk_rows=a.chunk_rows,
                                        chunk_cols=a.chunk_cols, check_group=a.check_group)
        log_s = torch.where(active, (stats[:, 0] + full.double()).clamp(max=0.0), 0.0)
    in_support = (logp != -math.inf) | ~active
    lead = a.lead
    return SampledLogProbs(logp.reshape(lead), entropy.reshape(lead), log_s.to(logp.dtype).reshape(lead),
                           in_support.reshape(lead))


def sampled_linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    sampling: SamplingParams,
    tp_group=None,
    *,
    bias: Optional[torch.Tensor] = None,
    vocab_start: Optional[int] = None,
    vocab_size: Optional[int] = None,
    ignore_index: int = -100,
    chunk_rows: Optional[int] = None,
    chunk_cols: Optional[int] = None,
    check_group: Optional[bool] = None,
    sequence_parallel: bool = False,
    batch_invariant: bool = False,
) -> SampledLogProbs:
    """:func:`sampled_log_probs` of the logits ``hidden @ weight.T + bias`` without the ``[N, V_local]`` logits
    tensor (as :func:`rollout_corr_ext.linear_log_probs`): the kept set is found from ``CHUNK_ROWS``-row chunks of the
    logits, computed and dropped one at a time, and the log-probs come from the fused chunked path with everything
    below each row's threshold at -inf. Differentiable in ``hidden``, ``weight`` and ``bias``; the temperature must be
    one number here. ``sequence_parallel``: as in :func:`rollout_corr_ext.linear_log_probs` (``hidden`` is this
    rank's piece of the sequence, gathered once for the search and the forward); ``batch_invariant``: as there (the
    search multiplies the same padded chunks, so the kept set is batch-invariant too)."""
    from . import linear as _linear

    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    if isinstance(sampling.temperature, torch.Tensor):
        raise ValueError("sampled_linear_log_probs: SamplingParams.temperature must be one number (per-row "
                         "temperatures: compute the logits and use sampled_log_probs)")
    if isinstance(hidden, torch.Tensor):
        _refuse_capture(hidden, "sampled_linear_log_probs")
    a = _linear.prepare(hidden, weight, target, tp_group, bias, vocab_start, vocab_size, sampling.temperature,
                         ignore_index, chunk_rows, chunk_cols, check_group, sequence_parallel, batch_invariant)
    whole = _linear.gather_sequence(a.hidden2d.detach(), tp_group, a.world) if a.sequence_parallel else None
    n, v_local = a.target1d.numel(), weight.shape[0]
    _check_entry(sampling, n, a.lead, tp_group, vocab_size, "this weight is")
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    temperature = 1.0 / a.inv_temp  # the floor in the fused path divides by this same number
    # The kept set is searched over exactly the logits chunks the fused path computes (its row chunks of the rows
    # it does not ignore, its vocab tiles, the same GEMM calls), so that every decision sees the very values the
    # forward and the backward see.
    valid, keep = _linear.valid_rows(a.target1d, a.ignore_index, hidden)
    rows = _linear.row_chunks(n, valid, a.chunk_rows)
    real_cols = min(max(a.vocab_size - a.vocab_start, 0), v_local)
    tiles = _linear.vocab_tiles(v_local, real_cols, a.chunk_cols)
    m = n if valid is None else valid.numel()
    index_of = {r0: index for r0, _, index in rows}
    h_data, w_data = (a.hidden2d.detach() if whole is None else whole), weight.detach()
    b_data = None if bias is None else bias.detach()
    active = torch.ones(m, dtype=torch.bool, device=hidden.device) if keep is None else keep

    # the fused path's own chunk GEMMs (padded rows in batch-invariant mode), into one reused buffer
    ws = _linear.Workspace(h_data, w_data, max(r1 - r0 for r0, r1, _ in rows),
                            max(c1 - c0 for c0, c1 in tiles), a.chunk_rows if a.batch_invariant else 0)

    def pieces(r0, r1):
        h = _linear.hidden_rows(h_data, r0, r1, index_of[r0], keep)
        for c0, c1 in tiles:
            yield ws.logits(h, w_data[c0:c1], None if b_data is None else b_data[c0:c1]).to(acc) / temperature

    def sub(value):  # per-row parameters of the computed rows
        if isinstance(value, torch.Tensor) and value.dim() and valid is not None:
            return value.reshape(-1)[valid.to(value.device)]
        return value

    params = SamplingParams(temperature=1.0, top_k=sub(sampling.top_k), top_p=sub(sampling.top_p),
                            min_p=sub(sampling.min_p))
    with torch.no_grad():
        th = kept_set(None, m, v_local, acc, hidden.device, params, active, (m,), tp_group, a.world,
                      chunks=[(r0, r1) for r0, r1, _ in rows], pieces=pieces,
                      row_id=None if valid is None else (lambda i: int(valid[i])),
                      what="logit from row {} of the flattened hidden states (hidden, weight or bias holds NaN / inf)",
                      extra_settings=(a.ignore_index, a.inv_temp, hidden.dtype, weight.dtype), vocab_size=a.vocab_size,
                      fn="sampled_linear_log_probs")
        floor = torch.full((n,), -math.inf, dtype=acc, device=hidden.device)
        log_s = torch.zeros(n, dtype=acc, device=hidden.device)
        th_floor = torch.where(active, th.threshold, torch.full_like(th.threshold, -math.inf))
        th_log_s = torch.where(active, th.log_kept_mass, torch.zeros_like(th.log_kept_mass))
        if valid is None:
            floor, log_s = th_floor, th_log_s
        else:
            floor.index_copy_(0, valid, th_floor)
            log_s.index_copy_(0, valid, th_log_s)
    ws = None  # the search's chunk buffer goes before the forward takes its own
    logp, entropy = _linear.LinearLogProbs.apply(a.hidden2d, weight, bias, a.target1d, tp_group, a.world,
                                                  a.vocab_start, a.vocab_size, a.inv_temp, a.ignore_index,
                                                  a.chunk_rows, a.chunk_cols, a.check_group, floor,
                                                  a.sequence_parallel, whole, a.batch_invariant)
    in_support = (logp != -math.inf) | (a.target1d == a.ignore_index)
    return SampledLogProbs(logp.reshape(a.lead), entropy.reshape(a.lead), log_s.reshape(a.lead),
                           in_support.reshape(a.lead))


def sampling_metrics(result: SampledLogProbs, response_mask: torch.Tensor, dp_group=None) -> dict:
    """How much the truncation mattered over the valid tokens (``response_mask`` != 0), reduced over ``dp_group``:
    ``rollout_corr/sampling_out_of_support_fraction`` (targets outside the kept set: left out of the loss),
    ``rollout_corr/sampling_kept_mass_mean`` / ``_min`` (S) and ``rollout_corr/sampling_log_kept_mass_mean``
    (log S, the factor every unreplayed ratio carried). 0-dim fp64 tensors; NaN, all four, when no rank holds a
    valid token (a statistic of no tokens, as the rollout correction's metrics are then)."""
    if not isinstance(result, SampledLogProbs):
        raise TypeError(f"result must be the SampledLogProbs a replay returns (sampled_log_probs, "
                        f"sampled_linear_log_probs), got {type(result).__name__}")
    check_mask("response_mask", response_mask, result.log_prob, "the log-probs")
    m = response_mask != 0
    ls = result.log_kept_mass.to(torch.float64)
    zero = torch.zeros_like(ls)
    sums = torch.stack([m.sum().to(torch.float64), (m & ~result.in_support).sum().to(torch.float64),
                        ordered_sum(torch.where(m, ls.exp(), zero)), ordered_sum(torch.where(m, ls, zero))])
    neg_min = torch.where(m, -ls.exp(), torch.full_like(ls, -math.inf)).amax() if m.numel() else \
        torch.tensor(-math.inf, dtype=torch.float64, device=ls.device)
    world = dist.get_world_size(dp_group) if dp_group is not None else 1
    sums = _all_reduce(sums, dist.ReduceOp.SUM, dp_group, world)
    neg_min = _all_reduce(neg_min.reshape(1), dist.ReduceOp.MAX, dp_group, world)[0]
    n = sums[0]  # 0 / 0 and -(-inf) where there is no valid token: NaN instead (a min of nothing is not +inf)
    out = torch.stack([sums[1] / n, sums[2] / n, -neg_min, sums[3] / n])
    out = torch.where(n > 0, out, torch.full_like(out, math.nan))
    names = ("out_of_support_fraction", "kept_mass_mean", "kept_mass_min", "log_kept_mass_mean")
    return {f"rollout_corr/sampling_{k}": v for k, v in zip(names, out.unbind())}
