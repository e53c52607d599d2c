"""The rollout-correction layouts, read from the one declaration the C++ kernels compile:
``csrc/include/rollout_correction_layout.def`` (X-macros). Nothing here lists a slot by hand.

``SEQ``: column -> index of the per-sequence aggregates ``[B, SEQ_COLS]`` (``SEQ_NUM_SUMS`` sums first, then maxima).
``SUM`` / ``MAX``: slot -> index of the partial vectors; the SUM vector continues with ``HIST_BINS`` histogram counts
at ``SUM_HIST``, then one block of ``CRIT_SUM`` slots per RS criterion from ``SUM_CRIT_BASE``; the MAX vector with one
block of ``CRIT_MAX`` slots per criterion from ``MAX_CRIT_BASE``. ``CONST``: the shared constants; ``IS_LEVEL``,
``RS_LEVEL``, ``RS_STAT``: the codes the op schemas take.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, List, Tuple

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


def partial_sizes(num_rs: int) -> Tuple[int, int]:
    """Lengths of the SUM and MAX partial vectors for ``num_rs`` RS criteria."""
    return SUM_CRIT_BASE + num_rs * len(CRIT_SUM), MAX_CRIT_BASE + num_rs * len(CRIT_MAX)


def crit_sum(i: int, name: str) -> int:
    """Index in the SUM vector of slot ``name`` of criterion ``i``."""
    return SUM_CRIT_BASE + i * len(CRIT_SUM) + CRIT_SUM[name]


def crit_max(i: int, name: str) -> int:
    """Index in the MAX vector of slot ``name`` of criterion ``i``."""
    return MAX_CRIT_BASE + i * len(CRIT_MAX) + CRIT_MAX[name]
