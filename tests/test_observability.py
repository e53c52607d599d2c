"""verl's rollout-vs-actor debug metrics (rollout_corr_ext.observability.debug_metrics and the verl adapter's
calculate_debug_metrics): against verl 0.9.1's own function, an fp64 oracle, and exact over DP = 2 (gloo)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from rollout_corr_ext.observability import DEBUG_METRIC_KEYS, debug_metrics
from rollout_corr_testing.dist_utils import dist_params, run_workers
from rollout_corr_testing.skips import skip_unless_ci


def _inputs(b=6, t=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    rlp = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    lp = rlp + 0.1 * torch.randn(b, t, generator=g, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=g) > 0.3).long()
    return lp, rlp, mask


def _oracle(lp, rlp, mask):
    """Pearson / mean / Bessel std written out over the list of response tokens."""
    v = mask.bool()
    p, q = lp[v].exp().tolist(), rlp[v].exp().tolist()
    d = [abs(a - b) for a, b in zip(p, q)]
    n = len(d)
    mean = sum(d) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    mp, mq = sum(p) / n, sum(q) / n
    cov = sum((a - mp) * (b - mq) for a, b in zip(p, q))
    corr = cov / math.sqrt(sum((a - mp) ** 2 for a in p) * sum((b - mq) ** 2 for b in q))
    return [1.0, max(d), mean, std, corr]


def test_debug_metrics_equal_oracle_and_keys():
    lp, rlp, mask = _inputs()
    got = debug_metrics(lp, rlp, mask)
    assert tuple(got) == DEBUG_METRIC_KEYS
    assert all(v.dim() == 0 for v in got.values())
    for k, want in zip(DEBUG_METRIC_KEYS, _oracle(lp, rlp, mask)):
        assert float(got[k]) == pytest.approx(want, rel=1e-10, abs=1e-14), k


def _confident(n=4096, spread=1e-7, seed=7):
    """Log-probs within ``spread`` of 0 (confident tokens): one-pass sums of p p, q q, p q cancel to nothing here."""
    g = torch.Generator().manual_seed(seed)
    rlp = -spread * torch.rand(2, n // 2, generator=g, dtype=torch.float64)
    lp = rlp + 0.05 * spread * torch.randn(2, n // 2, generator=g, dtype=torch.float64)
    return lp, rlp, torch.ones(2, n // 2, dtype=torch.long)


def _centred_oracle(lp, rlp, mask):
    """Two-pass fp64 over the response tokens, on p - 1 = expm1(log p) (exact near 1)."""
    v = mask.bool()
    p, q = torch.expm1(lp[v]), torch.expm1(rlp[v])
    d = (p - q).abs()
    pc, qc = p - p.mean(), q - q.mean()
    return [1.0, float(d.max()), float(d.mean()), float(d.std()), float((pc * qc).sum() / (pc.norm() * qc.norm()))]


@pytest.mark.parametrize("spread", [1e-6, 1e-7, 1e-8])
def test_debug_metrics_confident_tokens(spread):
    """Pearson and std from centred sums (before: one-pass sums gave a correlation of 1.1, or inf, at spread 1e-8)."""
    lp, rlp, mask = _confident(spread=spread)
    got = debug_metrics(lp, rlp, mask)
    corr = float(got[DEBUG_METRIC_KEYS[4]])
    assert -1.0 <= corr <= 1.0
    for k, want in zip(DEBUG_METRIC_KEYS, _centred_oracle(lp, rlp, mask)):
        assert float(got[k]) == pytest.approx(want, rel=1e-9, abs=0), k


def test_debug_metrics_empty_and_single_token():
    lp, rlp, mask = _inputs()
    got = debug_metrics(lp, rlp, torch.zeros_like(mask))
    assert float(got[DEBUG_METRIC_KEYS[0]]) == 0 and all(math.isnan(float(got[k])) for k in DEBUG_METRIC_KEYS[1:])
    one = torch.zeros_like(mask)
    one[1, 3] = 1
    got = debug_metrics(lp, rlp, one)
    assert float(got[DEBUG_METRIC_KEYS[2]]) == pytest.approx(abs(math.exp(lp[1, 3]) - math.exp(rlp[1, 3])))
    assert math.isnan(float(got[DEBUG_METRIC_KEYS[3]]))  # torch.std of one value


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [2, 29, 31, 300])
def test_debug_metrics_constant_side_has_no_correlation(n, dtype):
    """Pearson's r of a side whose values are all equal is 0 / 0: NaN, and the std of a constant |p - q| is 0. The
    mean sum / n is not exact, so the centred sums were rounding noise and noise / noise read +-1 after the clamp
    (n = 29: 1.0, n = 31: -1.0; a correlation of -1 reads as a severe mismatch; the versions fuzz). A side that
    varies keeps its correlation."""
    g = torch.Generator().manual_seed(n)
    const = torch.full((n,), -0.1, dtype=dtype)
    other = torch.full((n,), -0.3, dtype=dtype)
    varied = (-torch.rand(n, generator=g, dtype=torch.float64)).to(dtype)
    mask = torch.ones(n)
    got = debug_metrics(const, other, mask)
    assert math.isnan(float(got[DEBUG_METRIC_KEYS[4]]))
    assert float(got[DEBUG_METRIC_KEYS[3]]) == 0.0
    assert float(got[DEBUG_METRIC_KEYS[2]]) == pytest.approx(abs(math.exp(float(const[0])) - math.exp(float(other[0]))))
    for a, b in ((const, varied), (varied, const)):
        assert math.isnan(float(debug_metrics(a, b, mask)[DEBUG_METRIC_KEYS[4]]))
    # masked tokens do not make a side vary
    poisoned, pmask = torch.cat([const, torch.tensor([-5.0], dtype=dtype)]), torch.cat([mask, torch.zeros(1)])
    assert math.isnan(float(debug_metrics(poisoned, torch.cat([varied, varied[:1]]), pmask)[DEBUG_METRIC_KEYS[4]]))
    want = _centred_oracle(varied.double(), (varied.double() * 0.9).to(dtype).double(), mask)
    got = debug_metrics(varied, (varied.double() * 0.9).to(dtype), mask)
    assert float(got[DEBUG_METRIC_KEYS[4]]) == pytest.approx(want[4], rel=1e-9)


def test_calculate_debug_metrics_equals_verl():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from verl.protocol import DataProto
            from verl.utils.debug.metrics import calculate_debug_metrics as verl_fn
    except Exception as exc:  # noqa: BLE001
        skip_unless_ci(f"verl cannot be imported: {exc!r}")
    import rollout_corr_ext.verl as rv

    lp, rlp, mask = (x.float() if x.is_floating_point() else x for x in _inputs(seed=3))
    for batch in ({"response_mask": mask}, {"attention_mask": torch.cat([torch.ones(6, 4, dtype=torch.long), mask], 1)},
                  {}):
        data = DataProto.from_dict(tensors={"rollout_log_probs": rlp, "old_log_probs": lp,
                                            "responses": torch.zeros(6, 20, dtype=torch.long), **batch})
        want = verl_fn(data)
        got = rv.calculate_debug_metrics(data)
        assert list(got) == list(want)
        assert type(got["training/rollout_probs_diff_valid"]) is int
        for k, v in want.items():
            assert got[k] == pytest.approx(v, rel=2e-5, abs=2e-6), (k, got[k], v)


def _dp_worker(rank, world, lp, rlp, mask):
    import torch.distributed as dist

    rows = slice(0, 2) if rank == 0 else slice(2, None)  # unequal shares: per-rank values would differ
    want = debug_metrics(lp, rlp, mask)
    got = debug_metrics(lp[rows], rlp[rows], mask[rows], dp_group=dist.group.WORLD)
    for k in DEBUG_METRIC_KEYS:
        assert float(got[k]) == pytest.approx(float(want[k]), rel=1e-12, abs=1e-15), k
    lp, rlp, mask = _confident(spread=1e-8)  # the ranks' means differ: the between-ranks term is exact too
    want = _centred_oracle(lp, rlp, mask)
    got = debug_metrics(lp[rank:rank + 1], rlp[rank:rank + 1], mask[rank:rank + 1], dp_group=dist.group.WORLD)
    for k, w in zip(DEBUG_METRIC_KEYS, want):
        assert float(got[k]) == pytest.approx(w, rel=1e-9, abs=0), k
    # one side constant over the whole batch (each rank's share constant too): NaN on every rank; a side constant
    # on each rank but at two values across them varies, and has a correlation
    n = 15 + 16 * rank
    const = torch.full((n,), -0.1, dtype=torch.float64)
    other = -torch.rand(n, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    got = debug_metrics(const, other, torch.ones(n), dp_group=dist.group.WORLD)
    assert math.isnan(float(got[DEBUG_METRIC_KEYS[4]]))
    got = debug_metrics(const - 0.1 * rank, other, torch.ones(n), dp_group=dist.group.WORLD)
    assert not math.isnan(float(got[DEBUG_METRIC_KEYS[4]]))


@pytest.mark.parametrize("device", dist_params(2))
def test_debug_metrics_exact_over_dp(device):
    run_workers(_dp_worker, 2, *_inputs(seed=5), device=device)


def test_debug_metrics_and_staleness_refuse_bad_masks_by_name():
    """A complex mask, a mask of another shape or a non-tensor: a named error (a complex mask was read silently)."""
    from rollout_corr_ext.versions import staleness_metrics

    lp = torch.randn(2, 3, dtype=torch.float64)
    for bad, exc, words in ((torch.ones(2, 3, dtype=torch.complex64), TypeError, "must be a bool, integer or float"),
                            (torch.ones(3, 2), ValueError, "must have the shape of log_prob"),
                            ([[1, 1, 1]] * 2, TypeError, "must be a torch.Tensor")):
        with pytest.raises(exc, match=f"response_mask {words}"):
            debug_metrics(lp, lp, bad)
        if exc is not ValueError:
            with pytest.raises(exc, match=f"response_mask {words}"):
                staleness_metrics(torch.ones(2, 3, dtype=torch.long), 3, bad)
    with pytest.raises(TypeError, match="rollout_log_prob must be a bool, integer or float tensor"):
        debug_metrics(lp, lp.to(torch.complex128), torch.ones(2, 3))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values (NaN equal to NaN: an empty bucket's mean) of one shape and dtype."""
    return a.shape == b.shape and a.dtype == b.dtype and bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_every_metric_is_the_same_bits_in_every_layout_and_at_any_thread_count(dtype):
    """The fp64 metrics outside the kernels (verl's debug metrics, the diagnostics' divergences and |lr| spread, the
    proximal approximation's errors, sampling replay's kept mass) summed their masked per-token tensors in memory
    order, which ``torch.where`` takes from the mask: a column-major ``response_mask`` moved
    ``training/rollout_probs_diff_std`` and ``rollout_corr/js_divergence`` by an ulp (the input-layout fuzz), and
    past 32768 tokens the thread count moved them too. The same values in any layout (a transposed mask, transposed
    inputs, step-2 slices) and at 1, 2 and 3 threads: the same bits."""
    from rollout_corr_ext import RolloutCorrectionConfig, compute_rollout_correction
    from rollout_corr_ext.observability import MismatchDiagnostics
    from rollout_corr_ext.sampling import SampledLogProbs, sampling_metrics
    from rollout_corr_ext.versions import proximal_error_metrics, staleness_metrics

    b, t = 48, 1024  # 49152 tokens: a full reduction ATen splits over threads
    g = torch.Generator().manual_seed(41)
    rlp = (-torch.rand(b, t, generator=g, dtype=torch.float64) * 3).to(dtype)
    lp = (rlp.double() + 0.2 * torch.randn(b, t, generator=g, dtype=torch.float64)).clamp(max=0).to(dtype)
    mask = (torch.rand(b, t, generator=g) < 0.8).float()
    ent = (torch.rand(b, t, generator=g) * 5).to(dtype)
    versions = torch.randint(3, 8, (b, t), generator=g)
    ls = (-torch.rand(b, t, generator=g, dtype=torch.float64)).float()
    in_sup = torch.rand(b, t, generator=g) < 0.95
    cfg = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0)

    def metrics(lp, rlp, mask, ent, versions, ls, in_sup):
        diag = MismatchDiagnostics(entropy=ent, versions=versions, current_version=8)
        out = dict(debug_metrics(lp, rlp, mask))
        out.update(compute_rollout_correction(lp, rlp, mask, cfg, diagnostics=diag).metrics)
        out.update(proximal_error_metrics(lp, rlp, mask))
        out.update(staleness_metrics(versions, 8, mask))
        out.update(sampling_metrics(SampledLogProbs(lp.float(), ent.float(), ls, in_sup), mask))
        return out

    def tr(x):
        return x.t().contiguous().t()

    def step2(x):
        return torch.stack([x, torch.zeros_like(x)], -1)[..., 0]

    args = (lp, rlp, mask, ent, versions, ls, in_sup)
    want = metrics(*args)
    layouts = {"mask transposed": (lp, rlp, tr(mask)) + args[3:], "all transposed": tuple(map(tr, args)),
               "step-2 slices": tuple(map(step2, args))}
    for name, other in layouts.items():
        got = metrics(*other)
        bad = [k for k in want if not _same_bits(got[k], want[k])]
        assert not bad, (name, bad)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            got = metrics(*args)
            bad = [k for k in want if not _same_bits(got[k], want[k])]
            assert not bad, (n, bad)
    finally:
        torch.set_num_threads(threads)
