"""Memory traffic and coalescing of the CUDA kernels, measured by the emulator (issue §4).

While recording, the emulator logs every global access of the device code (RC_LDG / RC_STG: address, size, site,
thread) and groups them into warp-level requests (cuda_emu.h). These tests assert the design's traffic, buffer by
buffer: the log-prob forward reads each logit once (bytes read = N·V·b + O(N)), the backward reads the shard once
and writes it once, the policy-loss and rollout passes read each input once per pass; and every request of a
contiguous input or output touches the ideal number of 32-byte sectors (Nsight Compute's sectors per request), for
every dtype and vector width. A strided input is shown to be caught as uncoalesced, and the counters themselves are
checked on kernels whose traffic is known in advance.
"""

from __future__ import annotations

import pytest
import torch

from rollout_corr_testing.cuda_emulator.loader import load_emulator
from rollout_corr_testing.cuda_emulator.records import recorded_launches


@pytest.fixture(scope="module")
def emu():
    load_emulator()
    return torch.ops.rollout_corr_emu


def _one(rec, kernel, **buffers):
    launches = rec.launches(kernel, **buffers)
    assert len(launches) == 1, [x.kernel for x in rec.launches()]
    return launches[0]


def _assert_coalesced(launch):
    """No request of the launch touches more sectors than its bytes' alignment requires."""
    bad = [f"{s.where} ({'store' if s.store else 'load'}): {s.sectors} sectors in {s.requests} requests, minimum "
           f"{s.min_sectors}" for s in launch.uncoalesced_sites]
    assert not bad, f"{launch.kernel}: uncoalesced accesses:\n" + "\n".join(bad)


def _once(buf, size, read=True, aligned=True):
    """Every byte of the buffer read (or written) exactly once, by requests at Nsight's ideal sectors per request
    (the buffers of these tests start rows on 32-byte boundaries), or, for a layout whose rows do not
    (aligned=False), at the minimum their alignment allows."""
    if read:
        assert (buf.read_bytes, buf.read_unique, buf.read_max) == (size, size, 1), buf
        sec = buf.read_sectors
    else:
        assert (buf.write_bytes, buf.write_unique, buf.write_max) == (size, size, 1), buf
        sec = buf.write_sectors
    assert sec.requests > 0 and sec.sectors == (sec.ideal_sectors if aligned else sec.min_sectors), sec


# ---- the counters on kernels whose traffic is known ------------------------------------------------------------------

def test_sector_counts_of_known_access_patterns(emu):
    """fp32, 32 lanes: contiguous 4 sectors per request; stride 32 elements 32 (ideal and minimum 4); shifted by one
    element 5 (ideal 4, minimum given the alignment 5); every lane reading one address 1; 16-byte vectors 16."""
    x = torch.arange(256 * 32 + 32, dtype=torch.float32)
    y = torch.empty(256)
    cases = {
        "contiguous": (dict(pattern="gather"), 4, 4, 4),
        "strided": (dict(pattern="gather", stride=32), 32, 4, 4),
        "misaligned": (dict(pattern="gather", offset=1), 5, 4, 5),
        "broadcast": (dict(pattern="broadcast"), 1, 1, 1),
    }
    for name, (kw, sectors, ideal, minimum) in cases.items():
        with recorded_launches() as rec:
            emu.selftest_traffic(x=x, y=y, **kw)
        (launch,) = rec.launches(x=x, y=y)
        load = [s for s in launch.sites if not s.store][0]
        assert load.requests == 256 // 32, name
        per_request = tuple(v / load.requests for v in (load.sectors, load.ideal_sectors, load.min_sectors))
        assert per_request == (sectors, ideal, minimum), (name, load)
        assert launch.buffers["x"].read_sectors.sectors == load.sectors
        assert launch.write.sectors_per_request == 4 and launch.buffers["y"].write_unique == 256 * 4, name
    with recorded_launches() as rec:
        emu.selftest_traffic("vector", x, y, threads=32)
    (launch,) = rec.launches(x=x, y=y)
    assert (launch.read.requests, launch.read.sectors_per_request, launch.read.ideal_sectors_per_request) == (2, 16, 16)
    _once(launch.buffers["y"], 256 * 4, read=False)
    assert launch.buffers["x"].read_unique == 256 * 4


# ---- log-prob ---------------------------------------------------------------------------------------------------------

LOGPROB_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _logprob_inputs(rows, cols, vocab_size, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=g, dtype=torch.float64) * 3).to(dtype)
    t = torch.randint(0, vocab_size, (rows,), generator=g)
    t[1] = -100  # an ignored row
    return x, t


@pytest.mark.parametrize("dtype", LOGPROB_DTYPES, ids=str)
@pytest.mark.parametrize("vec", ["scalar", "wide"])
def test_logprob_forward_reads_each_logit_once(emu, dtype, vec):
    """vocab_row_stats: the shard's valid columns are read exactly once (the padding not at all), plus per row the
    target id and the target's logit (O(N)); the record is written once; every request is fully coalesced."""
    rows, cols, vocab_size = 5, 320, 300  # 20 padding columns; rows start on 32-byte boundaries
    elem, acc = dtype.itemsize, (8 if dtype == torch.float64 else 4)
    v = 1 if vec == "scalar" else 16 // elem
    x, t = _logprob_inputs(rows, cols, vocab_size, dtype)
    for knobs in (dict(vec=v), dict(vec=v, threads=64, max_blocks=2, schedule=2)):
        with recorded_launches() as rec:
            record = emu.vocab_row_stats(x, t, 0, vocab_size, 0.7, -100, True, **knobs)
        stats = _one(rec, "vocab_row_stats_kernel", logits=x, target=t, record=record)
        assert f", {v}, true>" in stats.kernel
        valid = rows * vocab_size * elem
        logits = stats.buffers["logits"]
        assert logits.read_unique == valid and logits.write_bytes == 0
        # Every byte once, but the target logit of each non-ignored row, which lane 0 reads again for the record.
        assert logits.read_bytes == valid + (rows - 1) * elem and logits.read_max == 2
        assert stats.buffers["target"].read_bytes == rows * 8
        assert stats.read.bytes == valid + (rows - 1) * elem + rows * 8 and stats.other_read_bytes == 0
        _once(stats.buffers["record"], rows * 5 * acc, read=False)
        assert stats.write.bytes == rows * 5 * acc and stats.other_write_bytes == 0
        _assert_coalesced(stats)
        header = _one(rec, "shard_header_kernel", target=t, record=record)
        _once(header.buffers["target"], rows * 8)
        assert header.buffers["record"].write_bytes == 64
        _assert_coalesced(header)


@pytest.mark.parametrize("dtype", LOGPROB_DTYPES, ids=str)
@pytest.mark.parametrize("vec", ["scalar", "wide"])
@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
def test_logprob_backward_reads_once_writes_once(emu, dtype, vec, inplace):
    """logprob_backward: the shard (padding included) read once and the gradient written once, in place too; per row
    only the row's constants (target, saved state, upstream gradients), broadcast to the block: one sector per warp."""
    rows, cols, vocab_size = 5, 320, 300
    elem, acc_dtype = dtype.itemsize, (torch.float64 if dtype == torch.float64 else torch.float32)
    acc = acc_dtype.itemsize
    v = 1 if vec == "scalar" else 16 // elem
    x, t = _logprob_inputs(rows, cols, vocab_size, dtype, seed=1)
    record = emu.vocab_row_stats(x, t, 0, vocab_size, 1.0, -100, True)
    _, _, _, state, _ = emu.merge_row_stats(record.unsqueeze(0), t, -100, vocab_size, 1.0, True)
    g = [torch.randn(rows, dtype=acc_dtype) for _ in range(3)]
    with recorded_launches() as rec:
        if inplace:
            grad = x.clone()
            emu.logprob_backward_(grad, *g, t, state, 0, vocab_size, 1.0, -100, vec=v)
        else:
            grad = emu.logprob_backward(*g, x, t, state, 0, vocab_size, 1.0, -100, vec=v)
    names = dict(grad=grad, target=t, state=state, g0=g[0], g1=g[1], g2=g[2])
    if not inplace:
        names["logits"] = x
    stats = _one(rec, "logprob_backward_kernel", **names)
    assert f", {v}>" in stats.kernel
    shard = rows * cols * elem
    if inplace:
        buf = stats.buffers["grad"]
        assert (buf.read_bytes, buf.read_unique, buf.read_max) == (shard, shard, 1)
        assert (buf.write_bytes, buf.write_unique, buf.write_max) == (shard, shard, 1)
    else:
        _once(stats.buffers["logits"], shard)
        _once(stats.buffers["grad"], shard, read=False)
        assert stats.buffers["logits"].write_bytes == 0 and stats.buffers["grad"].read_bytes == 0
    threads = stats.block[0]
    assert stats.buffers["target"].read_bytes == rows * threads * 8
    assert stats.buffers["state"].read_bytes == rows * threads * 3 * acc
    for k in range(3):  # the ignored row does not read its upstream gradients
        assert stats.buffers[f"g{k}"].read_bytes == (rows - 1) * threads * acc
    assert stats.read.bytes == shard + rows * threads * (8 + 3 * acc) + 3 * (rows - 1) * threads * acc
    assert stats.other_read_bytes == 0 and stats.write.bytes == shard
    _assert_coalesced(stats)


def test_logprob_merge_reads_each_record_once(emu):
    """merge_row_stats: each shard's row records read once, each output written once. One thread per row reads its
    row's 4-5 values: a warp's load of one column spans the 32 records (16 or 20 sectors against an ideal of 4),
    the warp's other column loads hit the same sectors (L1), so the sectors moved from L2 stay those of the
    records once; the records are R·N·(16|20) bytes, negligible next to the shard."""
    rows, widths, vocab_size = 64, [160, 160], 320
    x, t = _logprob_inputs(rows, sum(widths), vocab_size, torch.float32, seed=2)
    shards = torch.split(x, widths, dim=-1)
    gathered = torch.stack([emu.vocab_row_stats(s.contiguous(), t, 160 * k, vocab_size, 1.0, -100, True)
                            for k, s in enumerate(shards)])
    header = 64 // 4
    with recorded_launches() as rec:
        logp, ent, mean_logp, state, status = emu.merge_row_stats(gathered, t, -100, vocab_size, 1.0, True)
    stats = _one(rec, "merge_row_stats_kernel", rec0=gathered[0, header:], rec1=gathered[1, header:], target=t,
                 logp=logp, ent=ent, mean_logp=mean_logp, state=state)
    for k in range(2):  # the ignored row's records are not read
        buf = stats.buffers[f"rec{k}"]
        assert (buf.read_bytes, buf.read_unique, buf.read_max) == ((rows - 1) * 20, (rows - 1) * 20, 1)
        assert buf.read_sectors.per_request == 20 and buf.read_sectors.ideal_sectors / buf.read_sectors.requests <= 4
    _once(stats.buffers["target"], rows * 8)
    for name in ("logp", "ent", "mean_logp"):
        _once(stats.buffers[name], rows * 4, read=False)
    # [rows, 3]: lanes 12 bytes apart, each of the 3 column stores of a warp spans 384 bytes = 12 sectors (2 warps),
    # plus the ignored row's 3 single-lane stores.
    state_buf = stats.buffers["state"]
    assert (state_buf.write_bytes, state_buf.write_unique, state_buf.write_max) == (rows * 12, rows * 12, 1)
    assert state_buf.write_sectors.sectors == 3 * 2 * 12 + 3
    assert stats.read.unique_sectors <= -(-stats.read.unique_bytes // 32) + 4


# ---- policy loss ------------------------------------------------------------------------------------------------------

POLICY_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _policy_inputs(rows, cols, dtype, mask_all=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(rows, cols, generator=g, dtype=torch.float64)).to(dtype)
    old = (lp.double() + 0.3 * torch.randn(rows, cols, generator=g, dtype=torch.float64)).float()
    adv = torch.randn(rows, cols, generator=g)
    mask = torch.ones(rows, cols, dtype=torch.bool) if mask_all else torch.rand(rows, cols, generator=g) > 0.2
    w = torch.rand(rows, cols, generator=g) + 0.5
    return lp, old, adv, mask, w


@pytest.mark.parametrize("dtype", POLICY_DTYPES, ids=str)
def test_policy_loss_rows_reads_each_input_once(emu, dtype):
    """policy_loss_rows: log-prob, old log-prob, advantages, mask and weights read once; loss_mat written once, the
    row partials once (20 B per row); coalesced."""
    rows, cols = 5, 192
    lp, old, adv, mask, w = _policy_inputs(rows, cols, dtype)
    acc = 8 if dtype == torch.float64 else 4
    for knobs in (dict(), dict(threads=64, max_blocks=2, schedule=2)):
        with recorded_launches() as rec:
            loss, row = emu.policy_loss_rows(lp, old, adv, mask, w, 0.2, 0.3, 3.0, 0, **knobs)
        stats = _one(rec, "policy_loss_rows_kernel", lp=lp, old=old, adv=adv, mask=mask, w=w, loss=loss, row=row)
        inputs = 0
        for name, buf in (("lp", lp), ("old", old), ("adv", adv), ("mask", mask), ("w", w)):
            _once(stats.buffers[name], buf.numel() * buf.element_size())
            inputs += buf.numel() * buf.element_size()
        _once(stats.buffers["loss"], rows * cols * acc, read=False)
        _once(stats.buffers["row"], rows * 5 * acc, read=False)
        assert stats.read.bytes == inputs and stats.write.bytes == rows * cols * acc + rows * 5 * acc
        _assert_coalesced(stats)


@pytest.mark.parametrize("dtype", POLICY_DTYPES, ids=str)
def test_policy_loss_backward_reads_each_input_once(emu, dtype):
    """policy_loss_backward: the inputs and the upstream loss_mat gradient read once, the gradient written once; the
    row's upstream gradient is one broadcast value per token. (A full mask: the requests are grouped per lane by
    execution count, and a data-dependent load through a helper shared with other inputs would shift them.)"""
    rows, cols = 5, 192
    lp, old, adv, mask, w = _policy_inputs(rows, cols, dtype, mask_all=True)
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    g_mat = torch.randn(rows, cols, dtype=acc_dtype)
    g_rows = torch.randn(rows, dtype=acc_dtype)
    with recorded_launches() as rec:
        grad = emu.policy_loss_backward(g_mat, g_rows, lp, old, adv, mask, w, 0.2, 0.3, 3.0, 0)
    stats = _one(rec, "policy_loss_backward_kernel", lp=lp, old=old, adv=adv, mask=mask, w=w, g_mat=g_mat,
                 g_rows=g_rows, grad=grad)
    for name, buf in (("lp", lp), ("old", old), ("adv", adv), ("mask", mask), ("w", w), ("g_mat", g_mat)):
        _once(stats.buffers[name], buf.numel() * buf.element_size())
    assert stats.buffers["g_rows"].read_bytes == rows * cols * g_rows.element_size()
    assert stats.buffers["g_rows"].read_unique == rows * g_rows.element_size()
    _once(stats.buffers["grad"], rows * cols * dtype.itemsize, read=False)
    assert stats.other_read_bytes == 0 and stats.other_write_bytes == 0
    _assert_coalesced(stats)


def test_strided_input_is_caught_uncoalesced(emu):
    """A transposed log-prob (column stride = rows) is read in place, one sector per lane: 32 sectors per request
    against an ideal of 4 for fp32. (The op reads any stride without a copy; only contiguous inputs coalesce.)"""
    rows, cols = 64, 64
    lp, old, adv, mask, w = _policy_inputs(rows, cols, torch.float32)
    lp_t = lp.t().contiguous().t()
    with recorded_launches() as rec:
        emu.policy_loss_rows(lp_t, old, adv, mask, w, 0.2, 0.3, 3.0, 0)
    stats = _one(rec, "policy_loss_rows_kernel", lp=lp_t)
    (site,) = [s for s in stats.uncoalesced_sites if not s.store]
    assert site.file == "policy_loss_math.h" and site.sectors / site.requests == 32
    assert site.ideal_sectors / site.requests == 4
    assert stats.buffers["lp"].read_unique == rows * cols * 4


# ---- rollout correction -----------------------------------------------------------------------------------------------

ROLLOUT_CONFIG = dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1,seq_mean_k3",
                      rollout_rs_threshold="0.7_1.3,0.02", rollout_token_veto_threshold=0.6)


def _rollout_inputs(rows, cols, dtype, mask_dtype, seed=0):
    from rollout_corr_testing.rc_testutil import make_inputs

    lp, rlp, mask = make_inputs(rows, cols, seed=seed, scale=0.2, pad_rows=(1,))
    return lp.to(dtype), rlp.to(dtype), mask.to(mask_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32], ids=str)
def test_rollout_passes_read_each_input_once_per_pass(emu, dtype, mask_dtype):
    """Pass 1 reads log_prob, rollout_log_prob and the mask once and writes the row aggregates once; pass 2 reads the
    three inputs once more and writes the weights and the output mask once (the row aggregates are broadcast to the
    block, the per-block partial rows are scratch), the fold of the partial rows writes each metric slot once.
    Every request coalesced."""
    from rollout_corr_ext import RolloutCorrectionConfig as Cfg
    from rollout_corr_ext.correction import op_args

    rows, cols = 5, 96
    lp, rlp, mask = _rollout_inputs(rows, cols, dtype, mask_dtype)
    args = op_args(Cfg(**ROLLOUT_CONFIG))
    acc = 8 if dtype == torch.float64 else 4
    tokens = rows * cols
    for knobs in (dict(threads=32), dict(threads=64, max_blocks=2, schedule=2)):
        with recorded_launches() as rec:
            st = emu.rollout_seq_stats(lp, rlp, mask, None, *args, **knobs)
            w, m, sums, maxes = emu.rollout_token_pass(lp, rlp, mask, None, st, *args, True, **knobs)
        bufs = dict(lp=lp, rlp=rlp, mask=mask, st=st, w=w, m=m, sums=sums, maxes=maxes)
        p1 = _one(rec, "rollout_seq_stats_kernel", **bufs)
        p2 = _one(rec, "rollout_token_pass_kernel", **bufs)
        fold = _one(rec, "rollout_reduce_partials_kernel", **bufs)
        for p in (p1, p2):
            for name in ("lp", "rlp", "mask"):
                _once(p.buffers[name], tokens * bufs[name].element_size())
            _assert_coalesced(p)
        # [B, seq::kCols] aggregates: 88-byte rows in fp32 (176 in fp64), so a row's store may straddle a sector.
        _once(p1.buffers["st"], st.numel() * acc, read=False, aligned=False)
        assert p1.read.bytes == tokens * (2 * dtype.itemsize + mask.element_size())
        assert p1.write.bytes == st.numel() * acc and p1.other_read_bytes == p1.other_write_bytes == 0
        # Pass 2: the aggregates are read by every thread (one broadcast sector per warp), never written.
        assert p2.buffers["st"].read_unique <= st.numel() * acc and p2.buffers["st"].write_bytes == 0
        _once(p2.buffers["w"], tokens * acc, read=False)
        _once(p2.buffers["m"], tokens * m.element_size(), read=False)
        assert p2.buffers["sums"].write_bytes == 0 and p2.buffers["maxes"].write_bytes == 0
        _once(fold.buffers["sums"], sums.numel() * 8, read=False)
        _once(fold.buffers["maxes"], maxes.numel() * 8, read=False)
        _assert_coalesced(fold)


# ---- sampling replay -------------------------------------------------------------------------------------------------

SAMPLING_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@pytest.mark.parametrize("dtype", SAMPLING_DTYPES, ids=str)
def test_sampling_floor_ops_read_once(emu, dtype):
    """floor_fill reads the logits once and writes the output once; floor_zero_ reads the logits once and writes
    only the gradient elements it zeroes (the others are neither read nor written); count_at_least reads the row
    once and writes 8 B per row. The row's floor is one broadcast value per thread. Every request coalesced (but
    floor_zero_'s sparse stores, which the counters cannot group)."""
    import math

    rows, cols = 5, 320
    elem, acc = dtype.itemsize, (8 if dtype == torch.float64 else 4)
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    x = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2).to(dtype)
    floor = torch.tensor([0.0, -math.inf, 1.0, -1.0, 9.0], dtype=acc_dtype)
    out = torch.empty_like(x)
    grad = torch.ones_like(x)
    for knobs in (dict(), dict(threads=64, max_blocks=2, schedule=2)):
        with recorded_launches() as rec:
            emu.floor_fill(x, floor, 0.7, out, **knobs)
            emu.floor_zero_(grad, x, floor, 0.7, **knobs)
            counts = emu.count_at_least(x, floor, **knobs)
        fill = _one(rec, "floor_fill_kernel", x=x, out=out, floor=floor)
        _once(fill.buffers["x"], rows * cols * elem)
        _once(fill.buffers["out"], rows * cols * elem, read=False)
        assert fill.buffers["floor"].read_unique == rows * acc and fill.other_read_bytes == 0
        _assert_coalesced(fill)
        zero = _one(rec, "floor_zero_kernel", x=x, grad=grad, floor=floor)
        _once(zero.buffers["x"], rows * cols * elem)
        zeroed = int((out == -math.inf).sum())  # the elements under the floor
        assert zero.buffers["grad"].read_bytes == 0 and zero.buffers["grad"].write_bytes == zeroed * elem
        assert zero.buffers["grad"].write_max == 1
        # the loads coalesced (the emulator groups a data-dependent store's lanes by their execution count, which
        # mixes loop iterations: its sectors per request say nothing here)
        assert not [x for x in zero.uncoalesced_sites if not x.store], zero.uncoalesced_sites
        count = _one(rec, "count_at_least_kernel", x=x, counts=counts, floor=floor)
        _once(count.buffers["x"], rows * cols * elem)
        _once(count.buffers["counts"], rows * 8, read=False)
        assert count.other_read_bytes == 0 and count.other_write_bytes == 0
        _assert_coalesced(count)


@pytest.mark.parametrize("dtype", SAMPLING_DTYPES, ids=str)
def test_sampling_mass_histogram_reads_once(emu, dtype):
    """mass_histogram: the row read once, each row's probes once (into shared memory), its buckets written once; the
    row's bracket, floor and max are broadcast values."""
    from rollout_corr_ext.sampling import _ordered_key, _probes

    rows, cols = 4, 256
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    z = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3).to(dtype)
    z_max = z.to(acc_dtype).amax(1)
    floor = torch.full((rows,), -1.0, dtype=acc_dtype)
    hi, lo = _ordered_key(z_max), _ordered_key(z_max - 64) - 1
    probes = _probes(lo, hi, 8, acc_dtype)
    with recorded_launches() as rec:
        hist = emu.mass_histogram(z, z_max, floor, lo, hi, probes, threads=128)
    stats = _one(rec, "mass_histogram_kernel", z=z, probes=probes, hist=hist, z_max=z_max, floor=floor, lo=lo, hi=hi)
    _once(stats.buffers["z"], rows * cols * dtype.itemsize)
    _once(stats.buffers["probes"], probes.numel() * 8, aligned=False)  # 255 probes: 2040-byte rows
    _once(stats.buffers["hist"], hist.numel() * 8, read=False)
    for name in ("z_max", "floor", "lo", "hi"):
        assert stats.buffers[name].read_unique == rows * (8 if name in ("lo", "hi") else acc_dtype.itemsize), name
    assert stats.other_read_bytes == 0 and stats.other_write_bytes == 0
    _assert_coalesced(stats)


def test_sampling_row_candidates_reads_the_row_once_plus_its_marked_tiles(emu):
    """row_candidates: every valid column read once by the first pass, never the padding; the second reads only
    the tiles whose max reaches the k-th largest tile max (about k of the row's V / 32 tiles for i.i.d. logits: here
    under 4 % of the row), and the target once; the lists written once. Coalesced."""
    rows, cols, valid, k, width = 2, 32768, 32000, 20, 64
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(2)).bfloat16()
    ks = torch.full((rows,), k)
    tc = torch.tensor([3, 31999])
    with recorded_launches() as rec:
        vals, idx, count, st = emu.row_candidates(x, ks, tc, width, 0.8, valid)
    stats = _one(rec, "row_candidates_kernel", x=x, vals=vals, idx=idx, count=count, st=st, k=ks, tc=tc)
    logits = stats.buffers["x"]
    assert logits.read_unique == rows * valid * 2  # every valid column, no padding column
    extra = logits.read_bytes - rows * valid * 2
    assert 0 < extra < 0.04 * rows * valid * 2, extra
    for name, buf in (("vals", vals), ("idx", idx), ("count", count), ("st", st)):
        _once(stats.buffers[name], buf.numel() * buf.element_size(), read=False, aligned=name != "st")
    assert stats.other_read_bytes == 0 and stats.other_write_bytes == 0
    _assert_coalesced(stats)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_sampling_candidate_decide_and_row_topk_rounds(emu, dtype):
    """candidate_decide reads the candidates once per radix round: 8-bit digits of 32- (fp32) or 64-bit (fp64)
    keys for the k-th largest, one pass for the total mass, as many rounds for the top-p cut, one for the kept
    sums (with top-p: 10 reads in fp32, 18 in fp64); row_topk reads the row once per round plus once to gather.
    Every request coalesced; the per-row outputs written once."""
    import math

    rows, width = 4, 256
    rounds = dtype.itemsize  # 8-bit digits
    g = torch.Generator().manual_seed(3)
    cand = torch.randn(rows, width, generator=g, dtype=dtype)
    z_max = cand.double().amax(1)
    args = (cand, z_max, cand[:, 0].double(), torch.full((rows,), 50.0, dtype=torch.float64),
            torch.full((rows,), 30), torch.full((rows,), -math.inf, dtype=dtype),
            torch.full((rows,), 0.9, dtype=torch.float64))
    with recorded_launches() as rec:
        tau, out = emu.candidate_decide(*args)
        top = emu.row_topk(cand, 16)
    decide = _one(rec, "candidate_decide_kernel", cand=cand, tau=tau, out=out)
    buf = decide.buffers["cand"]
    assert buf.read_unique == cand.numel() * dtype.itemsize
    assert buf.read_bytes == (2 * rounds + 2) * cand.numel() * dtype.itemsize
    _once(decide.buffers["tau"], rows * dtype.itemsize, read=False)
    _once(decide.buffers["out"], rows * 32, read=False)
    _assert_coalesced(decide)
    topk = _one(rec, "row_topk_kernel", cand=cand, top=top)
    assert topk.buffers["cand"].read_bytes == (rounds + 1) * cand.numel() * dtype.itemsize
    _once(topk.buffers["top"], top.numel() * dtype.itemsize, read=False)
    _assert_coalesced(topk)


def test_sampling_scatter_rows_writes_the_candidates_only(emu):
    """scatter_rows: the indices read once, the values that have one read once; the kernel writes only those
    entries (the launcher zeroes the output with a memset first)."""
    values = torch.randn(3, 64)
    index = torch.stack([torch.randperm(500)[:64] for _ in range(3)])
    index[1, 40:] = -1
    with recorded_launches() as rec:
        out = emu.scatter_rows(values, index, 500, torch.bfloat16)
    stats = _one(rec, "scatter_rows_kernel", values=values, index=index, out=out)
    _once(stats.buffers["index"], index.numel() * 8)
    kept = int((index >= 0).sum())
    assert stats.buffers["values"].read_bytes == stats.buffers["values"].read_unique == kept * 4  # with an index
    assert (stats.buffers["out"].write_bytes, stats.buffers["out"].write_unique) == (kept * 2, kept * 2)
    assert stats.buffers["out"].read_bytes == 0
