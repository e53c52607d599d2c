"""A one-page mismatch report for a saved batch: ``python -m rollout_corr_ext.report BATCH.pt [--out PREFIX]``.

``BATCH.pt`` is a ``torch.save``-d dict with the tensors :func:`rollout_corr_ext.compute_rollout_correction` takes:
``log_prob`` (the trainer's), ``rollout_log_prob`` (the engine's) and ``response_mask``, ``[B, T]``; optionally
``config`` (a dict of :class:`~rollout_corr_ext.RolloutCorrectionConfig` fields; default: token TIS at 2 and no
rejection), ``versions`` (per-token or per-row policy versions) with ``current_version``, ``entropy`` (per token) and
``turn_ids`` (per token). The breakdowns and the worst rows are the correction's diagnostics
(:class:`~rollout_corr_ext.MismatchDiagnostics`, docs/rollout_correction.md). It writes ``PREFIX.png``
(one page, four panels) and ``PREFIX.json`` (every number drawn), and prints one verdict line per panel, judged
against the healthy ranges of docs/rollout_correction.md's metric table:

1. the token ratio histogram (log scale) with the IS thresholds drawn; verdict from p5 / p95 of the ratio (inside
   [0.8, 1.25]: healthy token-level mismatch) and ``kl`` (|kl| < 1e-3: bf16-level noise);
2. mismatch by position in the response: mean |log pi - log pi_rollout| per decile of each row's response length
   (mismatch that grows with length compounds in sequence-level weights);
3. mismatch by the token's probability under the trainer (bins of pi: 0-0.1, ..., 0.9-1), and by policy-version
   lag when ``versions`` are given;
4. the worst sequences: the rows with the largest mean |log-ratio|, their row ids, lengths and sequence log-ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import sys
from typing import Any, Dict, List, Optional

import torch

__all__ = ["build_report", "plot_report", "load_steps", "build_steps_report", "plot_steps_report", "main"]

#: Healthy ranges, from docs/rollout_correction.md's metric table.
HEALTHY_P5_P95 = (0.8, 1.25)
HEALTHY_KL = 1e-3
HEALTHY_RS_FRACTION = 0.05


#: Policy lags 0 .. 32 and turn ids 0 .. 63 have a bucket each in the report's breakdowns; larger ones share the last
#: bucket (a batch from a run's first version would otherwise ask for one bucket per lag: millions).
MAX_LAG_BUCKETS = 32
MAX_TURN_BUCKETS = 64


def _load(path: str) -> Dict[str, Any]:
    try:  # tensors and plain values only: no pickled code
        data = torch.load(path, map_location="cpu", weights_only=True)
    except OSError:  # missing, unreadable: main names it as it is
        raise
    except Exception as exc:  # truncated, not a torch.save file, code in it (the weights-only unpickler raises
        # RuntimeError, EOFError, UnpicklingError, or a KeyError on a text file)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        first = first if isinstance(exc, (RuntimeError, pickle.UnpicklingError)) and first else \
            f"{type(exc).__name__}: {first}".rstrip(": ")
        raise ValueError(f"{path}: not a readable torch.save file of tensors ({first})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a dict of tensors, got {type(data).__name__}")
    missing = [k for k in ("log_prob", "rollout_log_prob", "response_mask") if k not in data]
    if missing:
        raise ValueError(f"{path}: missing {missing} (needs log_prob, rollout_log_prob, response_mask)")
    return data


def _check_batch(batch: Dict[str, Any]) -> None:
    """The batch's entries, each checked by name: the report's errors say which entry is wrong."""
    def tensor(name, floating=None):
        t = batch[name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"batch[{name!r}] must be a tensor, got {type(t).__name__}")
        if floating is True and not t.is_floating_point():
            raise TypeError(f"batch[{name!r}] must be a floating-point tensor, got {t.dtype}")
        if floating is False and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
            raise TypeError(f"batch[{name!r}] must be an integer tensor, got {t.dtype}")
        return t

    tensor("log_prob", True)
    tensor("rollout_log_prob", True)
    tensor("response_mask")
    for name, floating in (("versions", False), ("turn_ids", False), ("entropy", True)):
        if batch.get(name) is not None:
            tensor(name, floating)
    _current_version(batch)
    config = batch.get("config")
    if config is not None and not isinstance(config, dict):
        raise TypeError(f"batch['config'] must be a dict of RolloutCorrectionConfig fields, got "
                        f"{type(config).__name__}")


def _current_version(batch: Dict[str, Any]) -> Optional[int]:
    """``batch['current_version']`` as an int (a torch.save-d 0-dim integer tensor read as its value; the batch
    itself is not modified), or None."""
    current = batch.get("current_version")
    if isinstance(current, torch.Tensor) and current.dim() == 0 and not current.is_floating_point() and \
            current.dtype != torch.bool:
        current = int(current)
    if current is not None and (isinstance(current, bool) or not isinstance(current, int)):
        raise TypeError(f"batch['current_version'] must be an int, got {type(current).__name__} {current!r}")
    return current


def build_report(batch: Dict[str, Any], worst: int = 5) -> Dict[str, Any]:
    """The numbers of the report (what ``PREFIX.json`` holds), from a batch dict (see the module docstring; not
    modified); ``worst``: how many of the worst sequences to list (0: none)."""
    from . import MismatchDiagnostics, RolloutCorrectionConfig, compute_rollout_correction

    if isinstance(worst, bool) or not isinstance(worst, int) or worst < 0:
        raise ValueError(f"worst (the number of worst sequences listed) must be an int >= 0, got {worst!r}")
    _check_batch(batch)
    lp = batch["log_prob"].double()
    rlp = batch["rollout_log_prob"].double()
    mask = batch["response_mask"] != 0
    if lp.dim() != 2 or lp.shape != rlp.shape or lp.shape != mask.shape:
        raise ValueError(f"log_prob, rollout_log_prob and response_mask must be [B, T] of one shape, got "
                         f"{tuple(lp.shape)}, {tuple(rlp.shape)}, {tuple(mask.shape)}")
    if not bool(mask.any()):
        raise ValueError("response_mask has no response token: nothing to report")
    cfg_fields = batch.get("config") or {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": None}
    cfg = RolloutCorrectionConfig.from_dict(cfg_fields)
    versions, current = batch.get("versions"), _current_version(batch)
    max_lag = 0
    if versions is not None:
        if current is None:
            raise ValueError("the batch has versions but no current_version")
        if versions.shape != lp.shape and tuple(versions.shape) != (lp.shape[0],):
            raise ValueError(f"versions must be per token {tuple(lp.shape)} or per row ({lp.shape[0]},), got "
                             f"{tuple(versions.shape)}")
        v = versions if versions.shape == lp.shape else versions.reshape(-1, 1).expand(lp.shape)
        lags = (current - v.long())[mask]
        max_lag = min(max(int(lags.max()), 0), MAX_LAG_BUCKETS)
    turns = batch.get("turn_ids")
    if turns is not None and turns.shape != lp.shape:
        raise ValueError(f"turn_ids must be per token {tuple(lp.shape)}, got {tuple(turns.shape)}")
    max_turns = min(int(turns[mask].max()) + 1, MAX_TURN_BUCKETS) if turns is not None else 1
    dspec = MismatchDiagnostics(entropy=batch.get("entropy"), turn_ids=turns, versions=versions,
                                current_version=current if versions is not None else None, top_k=worst,
                                max_lag=max_lag, max_turns=max(max_turns, 1))
    diag = compute_rollout_correction(lp, rlp, batch["response_mask"], cfg, diagnostics=dspec)
    result = diag
    from .observability import is_diagnostics_key

    metrics = {k: float(v) for k, v in result.metrics.items() if not is_diagnostics_key(k)}
    lr = (lp - rlp)[mask]
    ratio = lr.clamp(-20, 20).exp()
    out: Dict[str, Any] = {"tokens": int(mask.sum()), "rows": int(mask.shape[0]), "config": cfg.to_dict(),
                           "metrics": metrics}
    if lr.numel():
        q = torch.quantile(ratio, torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64)).tolist()
        out["ratio_p5"], out["ratio_p50"], out["ratio_p95"] = q
        out["kl"] = float((-lr).mean())
        lo, hi = float(lr.min()), float(lr.max())
        if max(abs(lo), abs(hi)) < 1:
            lo, hi = -1.0, 1.0
        elif hi - lo < 1e-9 * abs(lo):  # one value (or a few ulps apart): 40 bins of width 0 drew nothing
            lo, hi = lo - 0.5 * abs(lo), hi + 0.5 * abs(lo)
        edges = torch.linspace(lo, hi, 41, dtype=torch.float64)
        out["log_ratio_hist"] = {"edges": edges.tolist(),
                                 "counts": torch.histogram(lr.clamp(float(edges[0]), float(edges[-1])),
                                                           bins=edges).hist.tolist()}
    spec = cfg.is_spec
    out["is_thresholds"] = [] if spec is None else [x for x in (spec.lower, spec.upper) if x is not None]
    # the breakdowns and the worst rows are the correction's own diagnostics (docs/rollout_correction.md)
    d = diag.diagnostics
    m = diag.metrics

    def series(fam: str, labels: List[str]) -> List[Optional[float]]:
        vals = [float(m[f"rollout_corr/by_{fam}/{lab}/abs_log_ratio"]) for lab in labels]
        return [None if math.isnan(v) else v for v in vals]

    labels = dspec.bucket_labels()
    out["by_position_decile"] = series("position_decile", labels["position_decile"])
    out["by_probability_bin"] = series("probability", labels["probability"])
    if "entropy" in labels:
        out["entropy_edges"] = list(dspec.entropy_edges)
        out["by_entropy_bin"] = series("entropy", labels["entropy"])
    # the last turn / lag bucket takes what lies past max_turns / max_lag: empty (dropped) unless the batch's went
    # past the cap
    for fam, key in (("turn", "turn"), ("lag", "version_lag")):
        if fam in labels:
            labs, vals = list(labels[fam]), series(fam, labels[fam])
            if vals and vals[-1] is None:
                labs, vals = labs[:-1], vals[:-1]
            out[key + "_labels"], out["by_" + key] = labs, vals
    for k in ("reverse_kl", "js_divergence", "abs_log_ratio_mean", "abs_log_ratio_max"):
        out[k] = float(m["rollout_corr/" + k])
    names = d.reject_bit_names
    out["worst_rows"] = [
        {"row": int(r), "tokens": int(n), "mean_abs_log_ratio": float(a), "seq_log_ratio": float(s),
         "rejected_by": [names[i] for i in range(len(names)) if int(bits) >> i & 1]}
        for r, n, a, s, bits in zip(*(d.worst[k].tolist() for k in ("global_row", "tokens", "abs_log_ratio_mean",
                                                                       "log_ratio_sum", "reject_bits")))
        if r >= 0] if worst else []  # top_k = 0: the diagnostics keep no rows
    out["verdicts"] = _verdicts(out)
    return out


def _verdicts(r: Dict[str, Any]) -> List[str]:
    lines = []
    if "ratio_p5" in r:
        lo, hi = HEALTHY_P5_P95
        ok = lo <= r["ratio_p5"] and r["ratio_p95"] <= hi
        kl_ok = abs(r["kl"]) < HEALTHY_KL
        lines.append(f"ratio: p5 {r['ratio_p5']:.3f}, p95 {r['ratio_p95']:.3f} "
                     f"({'inside' if ok else 'OUTSIDE'} the healthy [{lo}, {hi}]); kl {r['kl']:.2e} "
                     f"({'bf16-level noise' if kl_ok else 'above the 1e-3 of bf16 noise'})")
    else:
        lines.append("ratio: no response tokens")
    dec = [x for x in r["by_position_decile"] if x is not None]
    if len(dec) >= 2:
        if dec[0] > 0:
            how = f"{'grows' if dec[-1] > 1.5 * dec[0] else 'flat'} along the response, x{dec[-1] / dec[0]:.2f}"
        else:  # no mismatch in the first decile: flat only if none in the last either
            how = "grows along the response, from 0" if dec[-1] > 0 else "flat along the response, 0 throughout"
        lines.append(f"position: mean |log-ratio| {dec[0]:.2e} in the first decile, {dec[-1]:.2e} in the last "
                     f"({how})")
    probs = [(i, x) for i, x in enumerate(r["by_probability_bin"]) if x is not None]
    if probs:
        i, x = max(probs, key=lambda t: t[1])
        lines.append(f"probability: the largest mismatch {x:.2e} is at pi in [{i / 10:.1f}, {(i + 1) / 10:.1f})")
    if r.get("by_version_lag"):
        lags = [(lab, x) for lab, x in zip(r["version_lag_labels"], r["by_version_lag"]) if x is not None]
        if lags:
            lines.append("version lag: " + ", ".join(f"lag {lab}: {x:.2e}" for lab, x in lags))
    if r.get("by_entropy_bin"):
        edges = [0.0] + r["entropy_edges"]
        ent = [(i, x) for i, x in enumerate(r["by_entropy_bin"]) if x is not None]
        if ent:
            i, x = max(ent, key=lambda t: t[1])
            hi = f"{edges[i + 1]:g}" if i + 1 < len(edges) else "inf"
            lines.append(f"entropy: the largest mismatch {x:.2e} is at entropy in [{edges[i]:g}, {hi})")
    if r.get("by_turn"):
        turns = [(lab, x) for lab, x in zip(r["turn_labels"], r["by_turn"]) if x is not None]
        if turns:  # turn ids < 0 mark tokens of no turn
            lines.append("turn: " + ", ".join(f"turn {lab}: {x:.2e}" for lab, x in turns))
    if "js_divergence" in r and not math.isnan(r["js_divergence"]):
        lines.append(f"divergence: Jensen-Shannon {r['js_divergence']:.2e}, reverse KL {r['reverse_kl']:.2e} nats "
                     f"per token")
    rs = r["metrics"].get("rollout_corr/rollout_rs_masked_fraction")
    if rs is not None:
        judged = "healthy" if rs < HEALTHY_RS_FRACTION else "above the 5 % of a healthy run"
        lines.append(f"rejection: {rs:.1%} of the tokens ({judged})")
    if r["worst_rows"]:
        w = r["worst_rows"][0]
        lines.append(f"worst sequence: row {w['row']} ({w['tokens']} tokens), mean |log-ratio| "
                     f"{w['mean_abs_log_ratio']:.2e}, sequence log-ratio {w['seq_log_ratio']:.3f}")
    return lines


def plot_report(r: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes[0][0]
    if "log_ratio_hist" in r:
        e, c = r["log_ratio_hist"]["edges"], r["log_ratio_hist"]["counts"]
        ax.bar(e[:-1], c, width=[b - a for a, b in zip(e[:-1], e[1:])], align="edge")
        for t in r["is_thresholds"]:
            ax.axvline(math.log(t), color="r", linestyle="--", label=f"IS bound {t:g}")
        if r["is_thresholds"]:
            ax.legend()
    ax.set_title("log pi - log pi_rollout (tokens)")
    ax.set_yscale("log")
    ax = axes[0][1]
    ax.plot(range(1, 11), [x if x is not None else float("nan") for x in r["by_position_decile"]], marker="o")
    ax.set_title("mean |log-ratio| by position decile")
    ax.set_xlabel("decile of the response")
    ax = axes[1][0]
    ax.plot([i / 10 + 0.05 for i in range(10)], [x if x is not None else float("nan")
                                                 for x in r["by_probability_bin"]], marker="o", label="by pi")
    if r.get("by_version_lag"):
        ax2 = ax.twiny()
        ax2.plot(range(len(r["by_version_lag"])), [x if x is not None else float("nan")
                                                   for x in r["by_version_lag"]], marker="s", color="g",
                 label="by version lag")
        ax2.set_xlabel("version lag")
    ax.set_title("mean |log-ratio| by the token's probability" + (" (green: by version lag)" if r.get(
        "by_version_lag") else ""), pad=24 if r.get("by_version_lag") else 6)
    ax.set_xlabel("pi (trainer)")
    ax = axes[1][1]
    ax.axis("off")
    rows = [[str(w["row"]), str(w["tokens"]), f"{w['mean_abs_log_ratio']:.2e}", f"{w['seq_log_ratio']:.3f}"]
            for w in r["worst_rows"]]
    if rows:
        ax.table(cellText=rows, colLabels=["row", "tokens", "mean |lr|", "seq lr"], loc="upper center")
    ax.set_title("worst sequences")
    fig.suptitle("\n".join(r["verdicts"]), fontsize=8, ha="left", x=0.02)
    fig.tight_layout(rect=(0, 0, 1, 0.85))
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ------------------------------------------------------------------------------------------- over steps

#: The per-step series the steps page draws: (panel title, [(label, key candidates in order)]).
STEP_PANELS = (
    ("KL(pi_rollout || pi_theta) per token", [("kl", ("rollout_corr/kl",)), ("k3_kl", ("rollout_corr/k3_kl",))]),
    ("token ratio p5 / p95", [("p5", ("rollout_corr/rollout_is_p5", "demo/token_ratio_p05")),
                              ("p95", ("rollout_corr/rollout_is_p95", "demo/token_ratio_p95"))]),
    ("fraction of tokens rejected", [("rejected", ("rollout_corr/rollout_rs_masked_fraction",
                                                   "rollout_corr/masked_fraction"))]),
    ("chi2 (token)", [("chi2_token", ("rollout_corr/chi2_token",))]),
)


def load_steps(path: str) -> List[Dict[str, Any]]:
    """A metrics ``.jsonl``: one JSON object per line, flat (the demo's ``metrics.jsonl``: ``setting``, ``step`` and
    the metric keys) or verl-style ``{"step": ..., "data": {...}}``. Missing ``setting``: one run; missing ``step``:
    the line's index within its setting."""
    records: List[Dict[str, Any]] = []
    seen: Dict[str, int] = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not a JSON object ({exc})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{n}: expected a JSON object, got {type(rec).__name__}")
            if isinstance(rec.get("data"), dict):
                rec = dict(rec["data"], **{k: v for k, v in rec.items() if k != "data"})
            setting = str(rec.get("setting", "run"))
            rec["setting"] = setting
            if "step" not in rec:
                rec["step"] = seen.get(setting, 0)
            elif isinstance(rec["step"], bool) or not isinstance(rec["step"], (int, float)) or \
                    _value(rec, ("step",)) is None:  # NaN, inf, or an int past float's range
                step = rec["step"]
                shown = f"an integer of {step.bit_length()} bits" if isinstance(step, int) and \
                    not isinstance(step, bool) else repr(step)
                raise ValueError(f"{path}:{n}: step must be a finite number, got {shown}")
            seen[setting] = seen.get(setting, 0) + 1
            records.append(rec)
    if not records:
        raise ValueError(f"{path}: no records")
    return records


def _value(rec: Dict[str, Any], keys) -> Optional[float]:
    """The first of ``keys`` that holds a finite number (a NaN or inf metric is no reading: a step without tokens)."""
    for k in keys:
        v = rec.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            try:
                f = float(v)
            except OverflowError:  # an integer past float's range
                continue
            if math.isfinite(f):
                return f
    return None


def build_steps_report(records: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per setting: each panel's series over steps, the last step's values and a verdict line (the healthy ranges
    of docs/rollout_correction.md), as the steps page's JSON holds them."""
    settings: Dict[str, List[Dict[str, Any]]] = {}
    for rec in records:
        settings.setdefault(rec["setting"], []).append(rec)
    out: Dict[str, Any] = {"settings": {}, "verdicts": []}
    for name, recs in settings.items():
        recs = sorted(recs, key=lambda r: r["step"])
        series = {label: [_value(r, keys) for r in recs] for _, entries in STEP_PANELS for label, keys in entries}
        last = {label: next((v for v in reversed(vals) if v is not None), None) for label, vals in series.items()}
        out["settings"][name] = {"steps": [r["step"] for r in recs], "series": series, "last": last}
        parts = []
        if last["kl"] is not None:
            parts.append(f"kl {last['kl']:.2e} ({'bf16-level noise' if abs(last['kl']) < HEALTHY_KL else 'above 1e-3'})")
        if last["p5"] is not None and last["p95"] is not None:
            lo, hi = HEALTHY_P5_P95
            inside = lo <= last["p5"] and last["p95"] <= hi
            parts.append(f"ratio p5 {last['p5']:.3f} / p95 {last['p95']:.3f} ({'inside' if inside else 'OUTSIDE'} "
                         f"[{lo}, {hi}])")
        if last["rejected"] is not None:
            ok = last["rejected"] < HEALTHY_RS_FRACTION
            parts.append(f"rejected {last['rejected']:.1%} ({'healthy' if ok else 'above 5 %'})")
        kl = [v for v in series["kl"] if v is not None]
        if len(kl) >= 4:
            q = max(1, len(kl) // 4)
            first, final = sum(map(abs, kl[:q])) / q, sum(map(abs, kl[-q:])) / q
            if first > 0 and final > 2 * first:
                parts.append(f"|kl| grows x{final / first:.1f} over the run")
        out["verdicts"].append(f"{name} (step {recs[-1]['step']}): " + ("; ".join(parts) or "no mismatch metrics"))
    return out


def plot_steps_report(r: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, (title, entries) in zip([a for row in axes for a in row], STEP_PANELS):
        for name, s in r["settings"].items():
            for j, (label, _) in enumerate(entries):
                ys = [float("nan") if v is None else v for v in s["series"][label]]
                if all(math.isnan(y) for y in ys):
                    continue
                ax.plot(s["steps"], ys, linestyle="-" if j == 0 else "--",
                        label=name if len(entries) == 1 else f"{name} {label}")
        ax.set_title(title)
        ax.set_xlabel("step")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    fig.suptitle("\n".join(r["verdicts"]), fontsize=7, ha="left", x=0.02)
    fig.tight_layout(rect=(0, 0, 1, 0.82))
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _json_safe(obj):
    """``obj`` with every NaN / inf float as None (null): strict JSON has no NaN."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rollout_corr_ext.report", description=__doc__.split("\n")[0])
    ap.add_argument("batch", help="a torch.save-d dict: log_prob, rollout_log_prob, response_mask [B, T], optional "
                                  "config, versions, current_version, entropy, turn_ids; or a metrics .jsonl (the "
                                  "demo's metrics.jsonl): the page over steps")
    ap.add_argument("--out", default=None, help="output prefix (default: the batch path without its extension)")
    ap.add_argument("--worst", type=int, default=5, help="worst sequences listed (default: %(default)s)")
    args = ap.parse_args(argv)
    prefix = args.out or os.path.splitext(args.batch)[0]
    out_dir = os.path.dirname(prefix) or "."
    if args.out and not os.path.isdir(out_dir):  # before the work: the outputs' directory is the caller's to make
        # (without --out it is the batch's own, named by the load's error if missing)
        ap.exit(2, f"{ap.prog}: error: --out {prefix!r}: no directory {out_dir!r} to write {prefix}.json / .png in\n")
    try:  # a bad input is one line naming it, not a traceback
        if args.batch.endswith(".jsonl"):
            report = build_steps_report(load_steps(args.batch))
            plot = plot_steps_report
        else:
            report = build_report(_load(args.batch), worst=args.worst)
            plot = plot_report
    except (ValueError, TypeError, OSError, pickle.UnpicklingError) as exc:
        ap.exit(2, f"{ap.prog}: error: {exc}\n")
    try:
        with open(prefix + ".json", "w") as f:
            json.dump(_json_safe(report), f, indent=1, allow_nan=False)
        plot(report, prefix + ".png")
    except OSError as exc:  # a directory not writable, a disk full
        ap.exit(2, f"{ap.prog}: error: writing {prefix}.json / .png: {exc}\n")
    for line in report["verdicts"]:
        print(line)
    print(f"wrote {prefix}.png and {prefix}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
