"""Every ```python block of README.md and docs/*.md runs as written.

Each block runs in two spawned gloo workers (``rollout_corr_testing.dist_utils.run_workers_preloaded``) with
megatron-core's ``parallel_state`` initialised at TP = 2 (DP = CP = 1), so snippets that take
``parallel_state``'s groups, or the names below, get real process groups, and every other snippet simply runs
on each rank. Every block gets a fresh process and namespace: what one snippet does to global state (verl's
policy-loss registry, ``rollout_corr_ext.verl.configure``) cannot leak into another, or into this process.

Snippets are illustrations that use a few names they do not define; the test provides exactly these (``INPUTS``,
CPU tensors of consistent shapes, b = 4, s = 8, V = 64, the same on both ranks except for the logits shard), and
only the ones a snippet reads:

* ``logits``: this rank's vocab shard of the output layer's logits ``[s, b, V/tp]``, fp32, requires grad;
* ``labels``: global token ids ``[s, b]`` (what megatron's cross entropy takes);
* ``log_prob``: pi_theta's log-probs ``[b, s]``, requires grad;
* ``old_log_prob``: pi_old's log-probs ``[b, s]`` (the trainer's recompute);
* ``rollout_log_prob``: the inference engine's log-probs ``[b, s]``, within 0.05 of ``old_log_prob``;
* ``response_mask``: ``[b, s]`` bool, the last tokens of two rows are padding;
* ``advantages``: ``[b, s]`` fp32, one value per row;
* ``dp_cp_group``, ``cp_group``: ``parallel_state.get_data_parallel_group(with_context_parallel=True)`` and
  ``parallel_state.get_context_parallel_group()``;
* ``batch``: a verl ``DataProto`` with ``old_log_probs``, ``rollout_log_probs`` and ``response_mask``;
* ``config``: a verl trainer config (OmegaConf) whose ``algorithm.rollout_correction`` is token TIS.

A snippet that defines ``forward_step(data_iterator, model)`` (docs/megatron.md) is then driven as megatron's
schedule drives one micro-batch: ``output, loss_func = forward_step(data_iterator, model)``, ``loss_func(output)``
must return megatron's 3-tuple ``(loss, num_tokens, {name: tensor})``, and ``loss.backward()`` runs. ``model`` is
a tiny embedding + vocab-parallel output layer (tokens ``[b, s]`` -> logits ``[s, b, V/tp]``) and the one batch
has ``tokens``, ``labels``, ``loss_mask``, ``old_logp``, ``rollout_logp``, ``advantages`` (all ``[b, s]``).

Markers, an HTML comment on the line right before the fence:

* ``<!-- snippet: needs-cuda -->``: the block cannot run on CPU; the test skips it with that reason.
* ``<!-- snippet: signatures -->``: the block lists function signatures ``name(params)`` of ``rollout_corr_ext``;
  instead of running it, the test checks each against ``inspect.signature`` of the real function (parameter
  names, order, kinds and defaults).

A block that mentions verl is skipped when verl cannot be imported, except under ``CI=true`` (as in
tests/test_verl_adapter.py). A failure names the block as ``file:line`` (the line of its opening fence); tracebacks point at the markdown
file's own line numbers.
"""

from __future__ import annotations

import inspect
import os
import re
import symtable
import warnings
from typing import Callable, Dict, List, NamedTuple, Optional

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC_FILES = ["README.md"] + sorted(
    os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))

FENCE_OPEN = re.compile(r"^```(?:python|py)\s*$")
MARKER = re.compile(r"^<!--\s*snippet:\s*([\w-]+)\s*-->\s*$")
MARKERS = {"needs-cuda", "signatures"}


class Snippet(NamedTuple):
    path: str        # relative to the repository root
    line: int        # 1-based line of the opening fence
    code: str
    marker: Optional[str]

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def extract(path: str) -> List[Snippet]:
    """The ```python / ```py blocks of one markdown file, with the marker comment right before each (if any)."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        lines = f.read().splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].startswith("```") and not FENCE_OPEN.match(lines[i]):  # another language: skip the block
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                i += 1
            i += 1
            continue
        if FENCE_OPEN.match(lines[i]):
            start, body = i, []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            if i == len(lines):
                raise ValueError(f"{path}:{start + 1}: unclosed ```python fence")
            marker = None
            m = MARKER.match(lines[start - 1]) if start > 0 else None
            if m:
                marker = m.group(1)
                if marker not in MARKERS:
                    raise ValueError(f"{path}:{start}: unknown snippet marker {marker!r} (known: {sorted(MARKERS)})")
            out.append(Snippet(path, start + 1, "\n".join(body) + "\n", marker))
        i += 1
    return out


SNIPPETS: Dict[str, List[Snippet]] = {p: extract(p) for p in DOC_FILES}
ALL = [s for p in DOC_FILES for s in SNIPPETS[p]]


# ------------------------------------------------------------------------------------------- the inputs

B, S, V, TP, H = 4, 8, 64, 2, 16   # rows (b), tokens per row (s), global vocab, tensor-parallel size, hidden


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tp_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank()


def _labels_bs() -> torch.Tensor:
    return torch.randint(0, V, (B, S), generator=_gen(1))


def _old_log_prob() -> torch.Tensor:
    return -torch.rand(B, S, generator=_gen(2)) * 3 - 0.05


def _rollout_log_prob() -> torch.Tensor:   # a small mismatch: |log-ratio| <= 0.05
    return _old_log_prob() + (torch.rand(B, S, generator=_gen(3)) - 0.5) * 0.1


def _response_mask() -> torch.Tensor:
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, 6:] = False
    mask[3, 5:] = False
    return mask


def _advantages() -> torch.Tensor:
    return torch.randn(B, 1, generator=_gen(4)).expand(B, S).contiguous()


def _logits() -> torch.Tensor:
    full = torch.randn(S, B, V, generator=_gen(5)) * 2
    v = V // TP
    return full[..., _tp_rank() * v:(_tp_rank() + 1) * v].clone().requires_grad_(True)


def _log_prob() -> torch.Tensor:
    return (_old_log_prob() + 0.02 * torch.randn(B, S, generator=_gen(6))).requires_grad_(True)


def _group(name: str) -> Callable[[], object]:
    def make():
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group(with_context_parallel=True) if name == "dp_cp" else \
            ps.get_context_parallel_group()
    return make


def _verl_batch():
    from verl.protocol import DataProto

    return DataProto.from_dict(tensors={"old_log_probs": _old_log_prob(), "rollout_log_probs": _rollout_log_prob(),
                                        "response_mask": _response_mask().float()})


def _verl_trainer_config():
    from omegaconf import OmegaConf

    return OmegaConf.create({"algorithm": {"rollout_correction": {
        "_target_": "verl.trainer.config.RolloutCorrectionConfig", "rollout_is": "token",
        "rollout_is_threshold": 2.0, "rollout_rs": None, "rollout_rs_threshold": None, "bypass_mode": False,
        "loss_type": "ppo_clip", "rollout_is_batch_normalize": False}}})


#: The names a snippet may use without defining them (see the module docstring), built on first use.
INPUTS: Dict[str, Callable[[], object]] = {
    "logits": _logits,
    "labels": lambda: _labels_bs().t().contiguous(),
    "log_prob": _log_prob,
    "old_log_prob": _old_log_prob,
    "rollout_log_prob": _rollout_log_prob,
    "response_mask": _response_mask,
    "advantages": _advantages,
    "dp_cp_group": _group("dp_cp"),
    "cp_group": _group("cp"),
    "batch": _verl_batch,
    "config": _verl_trainer_config,
}


class _TinyLM(torch.nn.Module):
    """tokens ``[b, s]`` -> this rank's vocab-parallel logits ``[s, b, V/tp]`` (an embedding and the rank's
    columns of the output layer, the same full weights on every rank)."""

    def __init__(self):
        super().__init__()
        g = _gen(7)
        self.embedding = torch.nn.Parameter(torch.randn(V, H, generator=g))
        out = torch.randn(H, V, generator=g) / H ** 0.5
        v = V // TP
        self.output = torch.nn.Parameter(out[:, _tp_rank() * v:(_tp_rank() + 1) * v].clone())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding[tokens.t()] @ self.output


def _data_iterator():
    labels = _labels_bs()
    tokens = torch.cat([torch.zeros(B, 1, dtype=torch.long), labels[:, :-1]], dim=1)
    return iter([{"tokens": tokens, "labels": labels, "loss_mask": _response_mask(), "old_logp": _old_log_prob(),
                  "rollout_logp": _rollout_log_prob(), "advantages": _advantages()}])


def _global_reads(code: str, filename: str) -> set:
    """Names the snippet reads as globals (module level or from inside its functions), not its locals."""
    names = set()

    def walk(table):
        for sym in table.get_symbols():
            if sym.is_referenced() and (table.get_type() == "module" or sym.is_global()):
                names.add(sym.get_name())
        for child in table.get_children():
            walk(child)

    walk(symtable.symtable(code, filename, "exec"))
    return names


def _drive_forward_step(forward_step) -> None:
    output, loss_func = forward_step(_data_iterator(), _TinyLM())
    result = loss_func(output)
    assert isinstance(result, tuple) and len(result) == 3, f"loss_func must return megatron's 3-tuple, got {result!r}"
    loss, num_tokens, report = result
    assert loss.dim() == 0 and torch.isfinite(loss), loss
    assert int(num_tokens) > 0 and isinstance(report, dict) and report, (num_tokens, report)
    loss.backward()


def _snippet_worker(rank: int, world_size: int, path: str, line: int, code: str) -> None:
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
    from megatron.core import parallel_state as ps

    # A rank that fails inside a TP collective leaves its peer waiting there: time out after a minute.
    ps.initialize_model_parallel(tensor_model_parallel_size=TP, distributed_timeout_minutes=1)
    try:
        filename = os.path.join(ROOT, path)
        padded = "\n" * line + code  # the code's first line is the fence's line + 1: tracebacks name the .md line
        namespace = {"__name__": "__snippet__"}
        namespace.update({name: make() for name, make in INPUTS.items() if name in _global_reads(padded, filename)})
        exec(compile(padded, filename, "exec"), namespace)
        if callable(namespace.get("forward_step")):
            _drive_forward_step(namespace["forward_step"])
    finally:
        ps.destroy_model_parallel()


# ------------------------------------------------------------------------------------------- signatures

def _signature_lines(snippet: Snippet) -> List[str]:
    """Split a signatures block into its ``name(params)`` entries (by bracket depth: entries span lines)."""
    entries, depth, current = [], 0, ""
    for ch in snippet.code:
        if depth == 0 and not current and ch.isspace():
            continue
        current += ch
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                entries.append(current)
                current = ""
    assert not current.strip() and entries, f"{snippet.where}: a signatures block holds only name(params) entries"
    return entries


def _check_signatures(snippet: Snippet) -> None:
    import rollout_corr_ext

    for entry in _signature_lines(snippet):
        name = entry[:entry.index("(")]
        stub_ns: dict = {}
        exec(compile(f"def {entry}: pass", snippet.where, "exec"), stub_ns)  # name(a, *, b=1) parses as a def
        documented = inspect.signature(stub_ns[name])
        real = inspect.signature(getattr(rollout_corr_ext, name))
        want = [(p.name, p.kind, p.default) for p in real.parameters.values()]
        got = [(p.name, p.kind, p.default) for p in documented.parameters.values()]
        assert got == want, f"{snippet.where}: documented {name}{documented} but the code has {name}{real}"


# ------------------------------------------------------------------------------------------- tests

def test_snippets_found():
    """Each file with ```python fences yields one snippet per fence (so a broken extractor cannot pass vacuously)."""
    assert SNIPPETS["README.md"], "README.md has no ```python snippet"
    for path in DOC_FILES:
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            fences = sum(1 for line in f if FENCE_OPEN.match(line.rstrip("\n")))
        if fences:
            assert len(SNIPPETS[path]) == fences > 0, f"{path}: {fences} ```python fences, {len(SNIPPETS[path])} found"


@pytest.mark.parametrize("snippet", ALL, ids=[s.where for s in ALL])
def test_snippet_runs(snippet: Snippet):
    if snippet.marker == "needs-cuda":
        pytest.skip(f"{snippet.where}: marked needs-cuda")
    if snippet.marker == "signatures":
        _check_signatures(snippet)
        return
    pytest.importorskip("megatron.core", reason="the snippets run under megatron-core's parallel_state")
    if re.search(r"\bverl\b", snippet.code) and os.environ.get("CI", "").lower() != "true":
        pytest.importorskip("verl", reason=f"{snippet.where} uses verl, which is not installed")
    from rollout_corr_testing.dist_utils import run_workers_preloaded

    failure = None
    try:
        run_workers_preloaded(_snippet_worker, 2, snippet.path, snippet.line, snippet.code,
                              preload=("megatron.core", "omegaconf"))
    except Exception as exc:  # noqa: BLE001 - reported below with the snippet's location
        failure = str(exc)
    if failure is not None:
        pytest.fail(f"{snippet.where}: the snippet failed\n{failure}", pytrace=False)
