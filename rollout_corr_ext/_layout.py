"""Every family's layout, read from the one declaration the C++ kernels compile (X-macros): rollout correction
(``csrc/include/rollout_correction_layout.def``), the log-prob records (``logprob_layout.def``) and the policy loss
(``policy_loss_layout.def``). Nothing here lists a slot by hand; the package, the fallback and the tests import these
names from here.

Rollout correction:

``SEQ``: column -> index of the per-sequence aggregates ``[B, SEQ_COLS]`` (``SEQ_NUM_SUMS`` sums first, then maxima).
``SUM`` / ``MAX``: slot -> index of the partial vectors; the SUM vector continues with ``HIST_BINS`` histogram counts
at ``SUM_HIST``, then one block of ``CRIT_SUM`` slots per RS criterion from ``SUM_CRIT_BASE``; the MAX vector with one
block of ``CRIT_MAX`` slots per criterion from ``MAX_CRIT_BASE``. ``CONST``: the shared constants; ``IS_LEVEL``,
``RS_LEVEL``, ``RS_STAT``: the codes the op schemas take.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional, Tuple

from ._build import CSRC

LAYOUT_FILE: Path = CSRC / "include" / "rollout_correction_layout.def"

_ENTRY = re.compile(r"^\s*(RC_[A-Z_]+)\(([^)]*)\)")


def _parse(path: Path) -> Dict[str, List[Tuple[str, ...]]]:
    tables: Dict[str, List[Tuple[str, ...]]] = {}
    for line in path.read_text().splitlines():
        m = _ENTRY.match(line)
        if not m or line.lstrip().startswith("#"):
            continue
        tables.setdefault(m.group(1), []).append(tuple(a.strip() for a in m.group(2).split(",")))
    return tables


_T = _parse(LAYOUT_FILE)


def _index(entries) -> Dict[str, int]:
    return {e[0]: i for i, e in enumerate(entries)}


CONST: Dict[str, float] = {name: float(value) for name, value in _T["RC_CONST"]}
_codes: Dict[str, Dict[str, int]] = {}
for group, name, value in _T["RC_CODE"]:
    _codes.setdefault(group, {})[name] = int(value)
IS_LEVEL: Dict[str, int] = _codes["is_level"]
RS_LEVEL: Dict[str, int] = _codes["rs_level"]
RS_STAT: Dict[str, int] = _codes["rs_stat"]

SEQ: Dict[str, int] = _index(_T["RC_SEQ_SUM"] + _T["RC_SEQ_MAX"])
SEQ_NUM_SUMS: int = len(_T["RC_SEQ_SUM"])
SEQ_COLS: int = len(SEQ)

SUM: Dict[str, int] = _index(_T["RC_SUM"])
MAX: Dict[str, int] = _index(_T["RC_MAX"])
CRIT_SUM: Dict[str, int] = _index(_T["RC_CRIT_SUM"])
CRIT_MAX: Dict[str, int] = _index(_T["RC_CRIT_MAX"])
#: Which slots the token loop accumulates (source TOKEN) and which are added once per sequence (source ROW).
SUM_SOURCE: Dict[str, str] = {e[0]: e[1] for e in _T["RC_SUM"]}
MAX_SOURCE: Dict[str, str] = {e[0]: e[1] for e in _T["RC_MAX"]}
CRIT_SUM_SOURCE: Dict[str, str] = {e[0]: e[1] for e in _T["RC_CRIT_SUM"]}
CRIT_MAX_SOURCE: Dict[str, str] = {e[0]: e[1] for e in _T["RC_CRIT_MAX"]}

HIST_BINS: int = int(CONST["hist_bins"])
HIST_LO: float = CONST["hist_lo"]
HIST_HI: float = CONST["hist_hi"]
SAFETY_BOUND: float = CONST["safety_bound"]
EPS: float = CONST["eps"]
MAX_CRITERIA: int = int(CONST["max_criteria"])
MAX_TOKEN_CRITERIA: int = int(CONST["max_token_criteria"])

SUM_HIST: int = len(SUM)
SUM_CRIT_BASE: int = SUM_HIST + HIST_BINS
MAX_CRIT_BASE: int = len(MAX)


# The configuration arguments of the rollout ops, in schema order: RC_ROLLOUT_CONFIG's X(name, schema type, C++ type)
# rows. The C++ schema, parameter list and argument struct are made from the same rows.
_CONFIG_ROW = re.compile(r"^\s*X\((\w+),\s*([^,]+?),\s*([^)]+?)\)")
_PY_TYPE = {"int": int, "bool": bool, "float": float, "float?": Optional[float], "int[]": List[int],
            "float[]": List[float], "bool[]": List[bool]}
ROLLOUT_CONFIG: Tuple[Tuple[str, str], ...] = tuple(
    (m.group(1), m.group(2)) for m in map(_CONFIG_ROW.match, LAYOUT_FILE.read_text().splitlines()) if m)
#: The typed configuration arguments of the rollout ops, a tuple in schema order (built from the rows above).
RolloutOpArgs = NamedTuple("RolloutOpArgs", [(name, _PY_TYPE[schema]) for name, schema in ROLLOUT_CONFIG])
RolloutOpArgs.__doc__ = ("The typed configuration arguments of the rollout ops, in schema order "
                         "(RC_ROLLOUT_CONFIG in csrc/include/rollout_correction_layout.def). Codes: IS_LEVEL / "
                         "RS_LEVEL / RS_STAT; one entry per RS criterion in the rs_* lists.")


def count_keeps_eps(mask_dtype) -> bool:
    """Whether verl's ``masked_mean`` (sum / (count + 1e-8)) keeps the 1e-8 for a mask of ``mask_dtype``: its
    count has the mask's dtype (an int / bool count is int64, + 1e-8 promotes it to torch's default dtype), and
    only an fp64 count keeps it (fp32 rounds n + 1e-8 to n for n >= 1). The kernels' ``Config::count_eps``
    (csrc/rollout_correction_host.h) follows the same rule. A bf16 / fp16 count, which verl rounds (257 -> 256 in
    bf16), is exact here (docs/from_verl.md)."""
    import torch

    if mask_dtype.is_floating_point:
        return mask_dtype == torch.float64
    return torch.get_default_dtype() == torch.float64


def partial_sizes(num_rs: int) -> Tuple[int, int]:
    """Lengths of the SUM and MAX partial vectors for ``num_rs`` RS criteria."""
    return SUM_CRIT_BASE + num_rs * len(CRIT_SUM), MAX_CRIT_BASE + num_rs * len(CRIT_MAX)


def crit_sum(i: int, name: str) -> int:
    """Index in the SUM vector of slot ``name`` of criterion ``i``."""
    return SUM_CRIT_BASE + i * len(CRIT_SUM) + CRIT_SUM[name]


def crit_max(i: int, name: str) -> int:
    """Index in the MAX vector of slot ``name`` of criterion ``i``."""
    return MAX_CRIT_BASE + i * len(CRIT_MAX) + CRIT_MAX[name]


# ---------------------------------------------------------------------------------------------------------------
# The log-prob family (csrc/include/logprob_layout.def) and the policy-loss family (policy_loss_layout.def)
# ---------------------------------------------------------------------------------------------------------------

LOGPROB_LAYOUT_FILE: Path = CSRC / "include" / "logprob_layout.def"
POLICY_LOSS_LAYOUT_FILE: Path = CSRC / "include" / "policy_loss_layout.def"


def _snake(name: str) -> str:
    """CamelCase (the .def spelling, C++'s k<Name>) -> UPPER_SNAKE (Python's)."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper()


def _number(text: str) -> float:
    return int(text, 0) if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", text) else float(text)


def _publish(tables, kind: str, prefix: str) -> int:
    """Module constants ``<prefix><NAME> = index`` for the entries of ``kind`` in order; returns their count."""
    for i, entry in enumerate(tables.get(kind, [])):
        globals()[prefix + _snake(entry[0])] = i
    return len(tables.get(kind, []))


_LP = _parse(LOGPROB_LAYOUT_FILE)
HEADER_SLOTS: int = _publish(_LP, "RC_LP_HDR", "HDR_")
HEADER_BYTES: int = HEADER_SLOTS * 8
ROW_STAT_COLS_WITH_SUM_Z: int = _publish(_LP, "RC_LP_ROW_STAT", "ROW_STAT_")
ROW_STATE_COLS: int = _publish(_LP, "RC_LP_ROW_STATE", "ROW_STATE_")
STATUS_SLOTS: int = _publish(_LP, "RC_LP_STATUS", "STATUS_")
_LP_CONST = {_snake(name): _number(value) for name, value in _LP["RC_LP_CONST"]}
SHARD_MAGIC: int = int(_LP_CONST["SHARD_MAGIC"])
FORMAT_NO_ENTROPY: int = int(_LP_CONST["FORMAT_NO_ENTROPY"])
SUM_Z_SCALE: float = float(_LP_CONST["SUM_Z_SCALE"])

_PG = _parse(POLICY_LOSS_LAYOUT_FILE)
for _name, _code in _PG["RC_PG_KIND"]:
    globals()["PG_KIND_" + _snake(_name)] = int(_code)
PG_ROW_COLS: int = _publish(_PG, "RC_PG_ROW", "PG_ROW_")
_PG_CONST = dict((_snake(n), _number(v)) for n, v in _PG["RC_PG_CONST"])
MASKED_MEAN_EPS: float = float(_PG_CONST["MASKED_MEAN_EPS"])
GSPO_LOG_RATIO_MAX: float = float(_PG_CONST["GSPO_LOG_RATIO_MAX"])
BERNOULLI_KL_EPS: float = float(_PG_CONST["BERNOULLI_KL_EPS"])
KIND_COUNT: int = int(_PG_CONST["KIND_COUNT"])
SCRATCH_SLOTS: int = int(_PG_CONST["SCRATCH_SLOTS"])
if sorted(int(c) for _, c in _PG["RC_PG_KIND"]) != list(range(KIND_COUNT)):
    raise RuntimeError(f"{POLICY_LOSS_LAYOUT_FILE}: the RC_PG_KIND codes must be 0 .. KindCount - 1")


def header_len(acc) -> int:
    """Length of the shard-record header in elements of the accumulation dtype ``acc`` (a torch dtype)."""
    import torch

    return HEADER_BYTES // torch.empty((), dtype=acc).element_size()


def layout_error(headers, vocab_size: int, unit: str = "rank") -> Optional[str]:
    """The verdict of the shard-header check on the host (the rules of check_shard_headers in logprob_math.h), or
    None when the shards fit: ``headers`` holds one list of HEADER_SLOTS ints per shard; ``unit`` names what one
    header belongs to in the message (a tensor-parallel rank, or a vocab tile of linear_log_probs)."""
    h0 = headers[0]
    for r, h in enumerate(headers):
        if h[HDR_MAGIC] != SHARD_MAGIC:
            return f"{unit} {r}'s record is not a log-prob shard record (different op or library version)"
        if h[HDR_ROWS] != h0[HDR_ROWS]:
            return f"{unit} 0 has {h0[HDR_ROWS]} rows but {unit} {r} has {h[HDR_ROWS]}"
        if h[HDR_FORMAT] != h0[HDR_FORMAT]:
            return (f"{unit}s 0 and {r} use different record formats or settings (temperature, ignore_index, "
                    f"return_entropy / label smoothing and the logits dtype must agree across the group)")
        if h[HDR_VOCAB_SIZE] != vocab_size:
            return (f"{unit} {r} was given vocab_size={h[HDR_VOCAB_SIZE]} but this rank {vocab_size} (pass the true, "
                    f"global vocab_size on every rank)")
        if h[HDR_TARGET_HASH] != h0[HDR_TARGET_HASH]:
            return f"{unit}s 0 and {r} were given different targets (every rank must pass the same global token ids)"
        for q in range(r):
            g = headers[q]
            if (h[HDR_VALID_COLS] > 0 and g[HDR_VALID_COLS] > 0 and h[HDR_VOCAB_START] < g[HDR_VOCAB_START]
                    + g[HDR_VALID_COLS] and g[HDR_VOCAB_START] < h[HDR_VOCAB_START] + h[HDR_VALID_COLS]):
                return f"the vocab ranges of {unit} {q} and {unit} {r} overlap (check vocab_start)"
    if sum(h[HDR_VALID_COLS] for h in headers) != vocab_size or any(h[HDR_VOCAB_START] < 0 for h in headers):
        shards = "; ".join(f"{r}: {h[HDR_VOCAB_START]}, {h[HDR_LOCAL_VOCAB]}, {h[HDR_VALID_COLS]}"
                           for r, h in enumerate(headers))
        return (f"the shards do not cover [0, vocab_size={vocab_size}) exactly; shards ({unit}: vocab_start, local "
                f"columns, columns below vocab_size): {shards}")
    return None
