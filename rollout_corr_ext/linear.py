"""Log-probs and entropy straight from hidden states: the output layer fused in, ``[N, V]`` never materialized.

``linear_log_probs(hidden, weight, target, tp_group)`` returns what
``vocab_parallel_log_probs(hidden @ weight.T (+ bias), target, tp_group)`` returns, for megatron-core's
``ColumnParallelLinear`` output layer (``weight`` is this rank's ``[V_local, H]`` shard), but computes the logits a
chunk at a time (rows x vocab tiles) with the device's GEMM (``torch.matmul``: MKL / oneDNN on CPU, cuBLAS on CUDA),
folds each chunk into its per-row shard record with the log-prob op's own kernel (``vocab_row_stats``: max, sum of
exponentials, sum of e^z z, target logit), and discards it. The records of every chunk of every rank travel in
**one** all-gather and are merged by the same kernel as the materialized path (``merge_row_stats``: each vocab tile
is a shard of the merge, so the layout checks, ``-inf`` rules, extreme-value handling and errors are exactly those
of :func:`~rollout_corr_ext.vocab_parallel_log_probs`). Backward recomputes each chunk, turns it into its logit
gradient in place (``logprob_backward_``) and accumulates ``grad_hidden`` (``g @ W``), ``grad_weight`` (``g.T @ h``)
and ``grad_bias``: no ``[N, V_local]`` buffer and no collective (each rank owns its shard's gradient; megatron's
``ColumnParallelLinear`` all-reduces ``grad_hidden`` over TP itself, as for the materialized output layer).

Accuracy: for bf16 / fp16 inputs each chunk's logits are the GEMM's fp32 accumulators, never rounded to 16 bits
(``ops.mm_f32_``: MKL's 16-bit GEMM with fp32 output on CPU, torch's ``out_dtype`` matmul on CUDA), so the log-probs
are those of the exact product ``h W^T`` to fp32 accuracy -- more accurate than a materialized 16-bit output
layer, whose logits carry a bf16 rounding of up to 0.03 at |z| ~ 8.

Memory model (beyond inputs and the gradients autograd must return): one logits chunk of
``chunk_rows x chunk_cols`` (fp32 for 16-bit inputs; in the 16-bit backward it also holds the gradient GEMMs'
products, and the chunk's gradient has a 16-bit copy), allocated once per call and reused by every chunk, the
records (16-20 bytes per row per vocab tile), and for 16-bit inputs the bf16 residuals of the hi/lo accumulators
(``ops.hilo_add_``) whose hi parts are the returned ``grad_hidden`` ``[N, H]`` and ``grad_weight`` tile (fp32
inputs accumulate into the returned gradients directly). See docs/logprobs.md.
"""

from __future__ import annotations

import functools
import math
import re
from typing import List, NamedTuple, Optional, Tuple, Union

import torch
import torch.distributed as dist

from rollout_corr_ext import _layout as LY, ops
from rollout_corr_ext.logprobs import (
    LOGPROB_OPS,
    all_gather,
    assert_status,
    group_size_rank,
    checked_inv_temperature,
    as_bool,
    as_int,
    check_single_shard,
    check_target,
    vocab_layout,
)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: Default chunk: 2048 rows x 2048 vocab columns (16 MiB of fp32 logits, 8 MiB of bf16): every GEMM is still
#: 2048 x 2048 x H, and narrow vocab tiles keep the 16-bit path's fp32 grad_weight tile accumulator small.
DEFAULT_CHUNK_ROWS = 2048
DEFAULT_CHUNK_COLS = 2048
#: The default (and padded) row chunk of ``batch_invariant=True``: every GEMM multiplies exactly this many rows, so
#: a short batch pays for them; 256 rows keep that small and the GEMM still efficient.
BATCH_INVARIANT_CHUNK_ROWS = 256


def _ranges(n: int, step: int) -> List[Tuple[int, int]]:
    """[start, end) pieces of [0, n) of length step (the last shorter); one empty piece when n == 0, so that every
    rank still takes part in the collective with a well-formed (empty) record."""
    return [(a, min(a + step, n)) for a in range(0, n, step)] or [(0, 0)]


_WIDE = (torch.float16, torch.bfloat16)


def logits_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the fused path's chunk logits: fp32 for 16-bit inputs (the GEMM's fp32 accumulators are never
    rounded to 16 bits, so the fused log-probs are those of the exact product to fp32 accuracy, not of its bf16
    rounding as a materialized 16-bit output layer gives them), else the inputs' own."""
    return torch.float32 if dtype in _WIDE else dtype


def chunk_logits(h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor],
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``h @ w.T + b`` in :func:`logits_dtype` (written into ``out`` when given: the caller's reused buffer; the
    tests build their chunked reference logits with it)."""
    if out is None:
        out = torch.empty((h.shape[0], w.shape[0]), dtype=logits_dtype(h.dtype), device=h.device)
    if h.dtype in _WIDE:
        ops.mm_f32_(out, h, w.t(), 0.0)
    else:
        torch.mm(h, w.t(), out=out)
    if b is not None:
        out += b  # a 16-bit bias is added to the fp32 logits exactly
    return out


class Workspace:
    """The chunk buffers of one forward or one backward, allocated once and reused by every chunk (fresh chunk-sized
    tensors per chunk would churn through the host allocator -- glibc then keeps the freed chunks in the process,
    raising its resident memory by hundreds of MiB at the default settings -- and through the CUDA caching
    allocator):

    * the logits chunk (:func:`logits_dtype`). In the 16-bit backward (``products=True``), once the chunk's gradient
      is copied to 16 bits, the same memory holds the gradient GEMMs' products (``[rows, H]`` and ``[cols, H]``:
      16-bit on a CPU with native 16-bit GEMMs, fp32 elsewhere; see :func:`_product`), so it is sized for the
      largest of the three;
    * the 16-bit copy of the chunk's gradient that the 16-bit GEMMs read, and the bf16 residual ``lo`` of the
      grad_weight tile's accumulator (:func:`_backward`);
    * with ignored rows left out, the chunk's gathered hidden rows, and for an fp32 accumulator the product of those
      rows (``[rows, H]`` each);
    * batch-invariant mode: the chunk's rows padded to ``pad_rows``.
    """

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, rows: int, cols: int, pad_rows: int = 0,
                 products: bool = False):
        self.rows, self.cols, self.pad_rows = max(rows, pad_rows, 0), max(cols, 0), pad_rows
        self.hidden, self.weight = hidden, weight
        size = self.rows * self.cols * torch.empty((), dtype=logits_dtype(hidden.dtype)).element_size()
        if products:
            native = hidden.device.type == "cpu" and _native_16bit_gemm(hidden.dtype)
            per = hidden.element_size() if native else 4
            size = max(size, max(self.rows, self.cols) * hidden.shape[-1] * per)
        self._bytes = size
        self._z = self._g16 = self._gh = self._h_pad = self._h_rows = self._lo = None

    def _scratch(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """``shape`` of ``dtype`` at the start of the logits / product memory."""
        if self._z is None:
            self._z = torch.empty(self._bytes, dtype=torch.uint8, device=self.hidden.device)
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return self._z[:n].view(dtype).view(shape)

    def logits(self, h, w, b) -> torch.Tensor:
        """The chunk's logits ``h @ w.T + b``. Batch-invariant mode (``pad_rows``): every GEMM multiplies exactly
        ``pad_rows`` rows (the chunk's, then zero rows), so its shape, and with it the GEMM's blocking and reduction
        order, never depends on how many rows the batch has or where this one sits; the padding's logits are
        dropped."""
        r = h.shape[0]
        if self.pad_rows > r:
            if self._h_pad is None:
                self._h_pad = torch.zeros((self.pad_rows, h.shape[1]), dtype=h.dtype, device=h.device)
            self._h_pad[:r].copy_(h)
            self._h_pad[r:].zero_()
            h = self._h_pad
        m, c = h.shape[0], w.shape[0]
        return chunk_logits(h, w, b, self._scratch((m, c), logits_dtype(h.dtype)))[:r]

    def product(self, m: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        """An ``[m, n]`` buffer for a gradient GEMM's product (16-bit backward only: it overwrites the logits chunk,
        whose gradient has been copied to 16 bits by then)."""
        return self._scratch((m, n), dtype)

    def sixteen(self, g: torch.Tensor) -> torch.Tensor:
        """The gradient chunk rounded to the inputs' 16-bit dtype (once, as a 16-bit logits gradient is)."""
        if self._g16 is None:
            self._g16 = torch.empty(self.rows * self.cols, dtype=self.hidden.dtype, device=g.device)
        return self._g16[:g.numel()].view(g.shape).copy_(g)

    def tile_residual(self, c: int) -> torch.Tensor:
        """The bf16 ``lo`` of a ``[c, H]`` grad_weight tile's hi/lo accumulator, zeroed."""
        if self._lo is None:
            self._lo = torch.empty(self.cols * self.hidden.shape[-1], dtype=torch.bfloat16, device=self.hidden.device)
        return self._lo[:c * self.hidden.shape[-1]].view(c, self.hidden.shape[-1]).zero_()

    def gathered_rows(self, index: torch.Tensor) -> torch.Tensor:
        """``hidden[index]`` (a chunk's computed rows when ignored rows are left out) in a reused buffer."""
        hsize = self.hidden.shape[-1]
        if self._h_rows is None:
            self._h_rows = torch.empty(self.rows * hsize, dtype=self.hidden.dtype, device=self.hidden.device)
        return torch.index_select(self.hidden, 0, index, out=self._h_rows[:index.numel() * hsize].view(-1, hsize))

    def row_product(self, r: int, dtype: torch.dtype) -> torch.Tensor:
        """An ``[r, H]`` buffer for the gathered rows' grad_hidden product (fp32 / fp64 accumulators)."""
        if self._gh is None:
            self._gh = torch.empty(self.rows * self.hidden.shape[-1], dtype=dtype, device=self.hidden.device)
        return self._gh[:r * self.hidden.shape[-1]].view(r, self.hidden.shape[-1])


@functools.lru_cache(maxsize=None)
def _native_16bit_gemm(dtype: torch.dtype) -> bool:
    """Whether oneDNN runs ``dtype`` GEMMs natively on this CPU (AVX512-BF16 / AVX512-FP16 or AMX). Without, torch's
    16-bit ``mm`` falls back to a reference loop: 1.1 s for a 512 x 2048 x 512 bf16 product on an AVX2-only EPYC
    where ``ops.mm_f32_`` takes 8 ms (a check by hand on that VM, 2026-11-29, not a script here)."""
    supported = (torch.ops.mkldnn._is_mkldnn_bf16_supported if dtype == torch.bfloat16
                 else torch.ops.mkldnn._is_mkldnn_fp16_supported)
    return bool(supported())


def _product(a: torch.Tensor, b: torch.Tensor, ws: "Workspace") -> torch.Tensor:
    """``a @ b`` for the 16-bit backward's gradient GEMMs, in the workspace's product memory. On a CPU with native
    16-bit GEMMs, the 16-bit GEMM (oneDNN, at bf16 speed), its product rounded to 16 bits once per chunk, as a
    materialized 16-bit output layer's gradient GEMMs round it: no library call torch exposes there writes fp32 from
    16-bit inputs at 16-bit speed (MKL's and torch's own run at fp32 GEMM speed), and the log-probs do not depend on
    these GEMMs. Elsewhere (CUDA, and CPUs without them: :func:`_native_16bit_gemm`): fp32 (``ops.mm_f32_``)."""
    if a.device.type == "cpu" and _native_16bit_gemm(a.dtype):
        return torch.mm(a, b, out=ws.product(a.shape[0], b.shape[1], a.dtype))
    out = ws.product(a.shape[0], b.shape[1], torch.float32)
    ops.mm_f32_(out, a, b, 0.0)
    return out


def _matmul_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool, ws: "Workspace") -> None:
    """``out (+)= a @ b`` with ``out`` in the accumulators' dtype (fp32 for 16-bit ``a``, ``b``, see
    :func:`_product`)."""
    if a.dtype in _WIDE and a.device.type == "cpu":
        prod = _product(a, b, ws)
        if accumulate:
            out.add_(prod)
        else:
            out.copy_(prod)
    elif a.dtype in _WIDE:
        ops.mm_f32_(out, a, b, 1.0 if accumulate else 0.0)
    elif accumulate:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)


# The merge's own messages (csrc/cpu/logprob.cpp) name a row of the logits it was given: for a chunk, the row
# within the chunk, of logits the caller never saw.
_MERGE_ROW = re.compile(r"in row (\d+) of the flattened logits|every logit of row (\d+)|target\.flatten\(\)\[(\d+)\]")


def _chunk_error(exc: RuntimeError, r0: int, index: Optional[torch.Tensor], dtype: torch.dtype) -> Exception:
    """The merge's error for a row chunk (rows r0, r0 + 1, ... of the flattened hidden states, or the rows ``index``
    when ignored rows were left out) restated for linear_log_probs' caller: the row of the flattened hidden states
    (and target), and what the logits are here. Anything else is returned unchanged."""
    msg = str(exc).split("\nException raised from")[0]
    m = _MERGE_ROW.search(msg)
    if m is None:
        return exc
    if m.group(3) is not None:
        row = _caller_row(r0, index, int(m.group(3)))
        value = msg[m.end():].split("=", 1)[-1].strip().split()[0]
        return ValueError(f"target holds an id outside [0, vocab_size) that is not ignore_index: "
                          f"target.flatten()[{row}] = {value}")
    if m.group(1) is not None:
        row = _caller_row(r0, index, int(m.group(1)))
        return ValueError(f"the logits hidden @ weight.T (+ bias) hold NaN or +inf in row {row} "
                          f"(hidden.reshape(-1, H)[{row}], on this rank or another rank of the tensor-parallel "
                          f"group): hidden, weight or bias holds NaN / inf there, or the product overflows {dtype}; "
                          f"rows whose target is ignore_index are exempt")
    row = _caller_row(r0, index, int(m.group(2)))
    return ValueError(f"every logit of row {row} (hidden.reshape(-1, H)[{row}] @ weight.T + bias, over all "
                      f"tensor-parallel shards) is -inf: its softmax is undefined; give such positions "
                      f"target = ignore_index")


def _caller_row(r0: int, index: Optional[torch.Tensor], k: int) -> int:
    return r0 + k if index is None else int(index[k])


def _can_compact(hidden: torch.Tensor) -> bool:
    """Whether the ignored rows may be left out of the GEMMs: finding them reads their count on the host, which a
    CUDA graph being captured cannot do (then they are zeroed instead: same values and gradients, full GEMMs)."""
    return not (hidden.is_cuda and torch.cuda.is_current_stream_capturing())


def valid_rows(target: torch.Tensor, ignore_index: int, hidden: torch.Tensor):
    """(valid, keep): the rows the GEMMs see. ``valid``: the indices of the rows whose target is not ``ignore_index``
    (None: every row, or see ``keep``); ignored rows are then never multiplied, so a NaN in their hidden state cannot
    reach any output or gradient, and RL batches (often a third to a half padding) skip their cost. One host read of
    the count (a sync on CUDA). Where that cannot be (:func:`_can_compact`), ``keep`` is the [N] mask of those rows
    and the chunks zero the others' hidden states instead."""
    ignored = target == ignore_index
    if not _can_compact(hidden):
        return None, ~ignored
    if not bool(ignored.any()):
        return None, None
    return torch.nonzero(~ignored).reshape(-1), None


def hidden_rows(hidden: torch.Tensor, r0: int, r1: int, index: Optional[torch.Tensor],
                 keep: Optional[torch.Tensor], ws: Optional["Workspace"] = None) -> torch.Tensor:
    """The chunk's hidden rows (gathered into ``ws``'s reused buffer when given and ignored rows are left out)."""
    h = ws.gathered_rows(index) if ws is not None and index is not None else _rows(hidden, r0, r1, index)
    return h if keep is None else torch.where(keep[r0:r1, None], h, torch.zeros((), dtype=h.dtype, device=h.device))


def row_chunks(n: int, valid: Optional[torch.Tensor], chunk_rows: int):
    """(r0, r1, index) per row chunk of the computed rows [0, n_valid): index None means rows r0:r1 of hidden."""
    count = n if valid is None else valid.numel()
    return [(r0, r1, None if valid is None else valid[r0:r1]) for r0, r1 in _ranges(count, chunk_rows)]


def _rows(x: torch.Tensor, r0: int, r1: int, index: Optional[torch.Tensor]) -> torch.Tensor:
    return x[r0:r1] if index is None else x.index_select(0, index)


def vocab_tiles(local_vocab: int, real_cols: int, chunk_cols: int) -> List[Tuple[int, int]]:
    """The vocab tiles of this shard: as many on every rank (their records are gathered together), each clipped to
    the columns below vocab_size (``real_cols``), so padded vocabulary rows of the weight are never multiplied; a
    tile entirely past vocab_size is empty (its record is the identity of the merge)."""
    return [(c0, max(c0, min(c1, real_cols))) for c0, c1 in _ranges(local_vocab, chunk_cols)]


class LinearLogProbs(torch.autograd.Function):
    """(hidden [N, H], weight [V_local, H], bias [V_local] or None, target [N]) -> (logp [N], entropy [N])."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, tp_group, world, vocab_start, vocab_size, inv_temperature,
                ignore_index, chunk_rows, chunk_cols, check_group, floor=None, sequence_parallel=False,
                gathered=None, batch_invariant=False):
        local = hidden
        if sequence_parallel:  # hidden: this rank's rows; the whole sequence is gathered (given: already gathered)
            hidden = gathered if gathered is not None else gather_sequence(local, tp_group, world)
        valid, keep = valid_rows(target, ignore_index, hidden)
        rows = row_chunks(hidden.shape[0], valid, chunk_rows)
        real_cols = min(max(vocab_size - vocab_start, 0), weight.shape[0])
        tiles = vocab_tiles(weight.shape[0], real_cols, chunk_cols)
        records = []
        pad_rows = chunk_rows if batch_invariant else 0
        ws = Workspace(hidden, weight, max(r1 - r0 for r0, r1, _ in rows), max(c1 - c0 for c0, c1 in tiles),
                        pad_rows)
        for r0, r1, index in rows:
            h, t = hidden_rows(hidden, r0, r1, index, keep, ws), _rows(target, r0, r1, index)
            for c0, c1 in tiles:
                z = ws.logits(h, weight[c0:c1], None if bias is None else bias[c0:c1])
                if floor is not None:
                    z = _below_floor_to_neg_inf(z, _rows(floor, r0, r1, index), inv_temperature)
                # Each vocab tile is one shard of the merge; the chunk is dropped as soon as its record is taken.
                records.append(ops.vocab_row_stats(z, t, vocab_start + c0, vocab_size, inv_temperature,
                                                   ignore_index, False))
                del z
        del ws
        lengths = [r.numel() for r in records]
        flat = torch.cat(records)
        if world > 1:
            if check_group:
                _check_headers(records, tp_group, world, vocab_size, len(rows), len(tiles))
            gathered = all_gather(flat, tp_group, world)  # the one collective: every chunk's record at once
        else:
            gathered = flat.unsqueeze(0)
        logps, entropies, states = [], [], []
        offset = 0
        for i, (r0, r1, index) in enumerate(rows):
            n_rec = lengths[i * len(tiles)]
            span = n_rec * len(tiles)
            shards = gathered[:, offset:offset + span].reshape(world * len(tiles), n_rec)
            offset += span
            try:
                logp, entropy, _, row_state, status = ops.merge_row_stats(
                    shards, _rows(target, r0, r1, index), ignore_index, vocab_size, inv_temperature, False)
            except RuntimeError as exc:  # CPU: the merge names rows of this chunk of its logits
                raise _chunk_error(exc, r0, index, hidden.dtype) from None
            if hidden.device.type == "cuda":
                assert_status(status)
            logps.append(logp)
            entropies.append(entropy)
            states.append(row_state)
        row_state = torch.cat(states)
        logp, entropy = torch.cat(logps), torch.cat(entropies)
        if valid is not None:  # ignored rows: log-prob and entropy 0, as the merge gives them
            logp = logp.new_zeros(hidden.shape[0]).index_copy_(0, valid, logp)
            entropy = entropy.new_zeros(hidden.shape[0]).index_copy_(0, valid, entropy)
        # A target under the floor has log-prob -inf: no gradient flows from it (its column is -inf).
        outside = None if floor is None else (logp == -math.inf)
        # Sequence parallel: only this rank's rows are kept for backward (gathered again there, as megatron's
        # output layer does), not the whole sequence.
        ctx.save_for_backward(local, weight, bias, target, row_state, valid, keep, floor, outside)
        ctx.args = (vocab_start, vocab_size, inv_temperature, ignore_index, chunk_rows, chunk_cols, real_cols)
        ctx.sp = (tp_group, world) if sequence_parallel and world > 1 else None
        ctx.pad_rows = pad_rows
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, target, row_state, valid, keep, floor, outside = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        if (grad_logp is None and grad_entropy is None) or not (need_h or need_w or need_b):
            return (None,) * 17
        if grad_logp is not None and outside is not None:
            grad_logp = grad_logp.masked_fill(outside, 0.0)
        with torch.no_grad():
            full = hidden if ctx.sp is None else gather_sequence(hidden, *ctx.sp)
            grads = _backward(full, weight, bias, target, row_state, valid, keep, grad_logp, grad_entropy,
                              *ctx.args, need_h, need_w, need_b, floor, sp=ctx.sp, pad_rows=ctx.pad_rows)
            del full
        if torch.is_grad_enabled():  # create_graph=True: differentiating these gradients again must raise
            anchors = [t for t in (hidden, weight, bias, grad_logp, grad_entropy)
                       if t is not None and t.requires_grad]
            if anchors:
                grads = tuple(None if g is None else ops.NoDoubleBackward.apply(g, LOGPROB_OPS, *anchors)
                              for g in grads)
        return grads + (None,) * 14


def _below_floor_to_neg_inf(z: torch.Tensor, floor: torch.Tensor, inv_temperature: float) -> torch.Tensor:
    """Sampling replay: the logits whose scaled value ``z / T`` (``T = 1 / inv_temperature``, divided as vLLM does,
    in fp32 / fp64) is below the row's floor become -inf (in place)."""
    acc = torch.float64 if z.dtype == torch.float64 else torch.float32
    return z.masked_fill_((z.to(acc) / (1.0 / inv_temperature)) < floor.unsqueeze(1), -math.inf)


def _backward(hidden, weight, bias, target, row_state, valid, keep, grad_logp, grad_entropy, vocab_start, vocab_size,
              inv_temperature, ignore_index, chunk_rows, chunk_cols, real_cols, need_h, need_w, need_b, floor=None,
              sp=None, pad_rows=0):
    """Per vocab tile (clipped to the real vocabulary), per chunk of the computed rows: recompute the logits, turn
    them into d(loss)/d(logits) in place, accumulate. Ignored rows and padded vocabulary rows are never multiplied:
    their gradients are exactly 0 whatever they hold. ``sp = (group, world)``: ``hidden`` is the gathered sequence
    and grad_hidden is reduce-scattered back to this rank's rows.

    16-bit inputs: the logits gradient is rounded to their dtype once (as a 16-bit materialized path has it), and
    each chunk's gradient GEMM product (:func:`_product`) is summed into a hi/lo pair (``ops.hilo_add_``): ``hi`` is
    the returned 16-bit gradient itself (``grad_hidden`` ``[N, H]``, the ``grad_weight`` tile), ``lo`` its bf16
    residual, together about 17 significant bits (an error of at most 2^-17 of the running sum per chunk, against
    the 2^-9 of rounding the result to bf16 once), in half the memory of an fp32 accumulator and with no 16-bit copy
    of it at the end. With ``sp``, grad_hidden is the whole sequence's, reduce-scattered in fp32: an fp32
    accumulator then."""
    exact = hidden.dtype not in _WIDE  # accumulate in the gradients' own dtype
    acc = hidden.dtype if exact else torch.float32
    hilo_h = need_h and not exact and sp is None
    lo_h = torch.zeros(hidden.shape, dtype=torch.bfloat16, device=hidden.device) if hilo_h else None
    grad_h = torch.zeros(hidden.shape, dtype=hidden.dtype if hilo_h else acc, device=hidden.device) if need_h else None
    # row-major whatever the weight's layout (a transposed / tied-embedding view): hilo_add_ needs unit column stride
    grad_w = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device) if need_w else None
    grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
    rows = row_chunks(hidden.shape[0], valid, chunk_rows)
    tiles = [(c0, c1) for c0, c1 in vocab_tiles(weight.shape[0], real_cols, chunk_cols) if c1 > c0]
    # the forward's GEMM shapes (batch-invariant mode: padded rows), so the recomputed logits are the forward's
    ws = Workspace(hidden, weight, max(r1 - r0 for r0, r1, _ in rows), max((c1 - c0 for c0, c1 in tiles), default=0),
                    pad_rows, products=not exact)
    if need_w and real_cols < weight.shape[0]:
        grad_w[real_cols:].zero_()
    for c0, c1 in tiles:
        w = weight[c0:c1]
        b = None if bias is None else bias[c0:c1]
        gw = lo_w = None
        if need_w:
            gw = grad_w[c0:c1]
            if not exact:
                gw.zero_()
                lo_w = ws.tile_residual(c1 - c0)
        first = True  # fp32 / fp64: the first row chunk writes the grad_weight tile, later ones accumulate
        for r0, r1, index in rows:
            if r1 == r0:
                continue
            h = hidden_rows(hidden, r0, r1, index, keep, ws)
            g = ws.logits(h, w, b)  # recomputed, then overwritten with d(loss)/d(logits)
            if floor is not None:  # the same kept set as the forward: the gradient is 0 outside it
                g = _below_floor_to_neg_inf(g, _rows(floor, r0, r1, index), inv_temperature)
            ops.logprob_backward_(g, None if grad_logp is None else _rows(grad_logp, r0, r1, index),
                                  None if grad_entropy is None else _rows(grad_entropy, r0, r1, index), None,
                                  _rows(target, r0, r1, index), row_state[r0:r1], vocab_start + c0, vocab_size,
                                  inv_temperature, ignore_index)
            if need_b:
                grad_b[c0:c1] += g.sum(0, dtype=acc)
            g_in = g if exact else ws.sixteen(g)  # what the GEMMs read; g's memory now holds their products
            if hilo_h:
                if index is None:
                    ops.hilo_add_(grad_h[r0:r1], lo_h[r0:r1], _product(g_in, w, ws))
                else:
                    ops.hilo_add_(grad_h, lo_h, _product(g_in, w, ws), index)
            elif need_h:
                if index is not None:
                    part = ws.row_product(r1 - r0, acc)
                    _matmul_into(part, g_in, w, False, ws)
                    grad_h.index_add_(0, index, part)
                else:
                    _matmul_into(grad_h[r0:r1], g_in, w, True, ws)
            if need_w and exact:
                _matmul_into(gw, g_in.t(), h, not first, ws)
            elif need_w:
                ops.hilo_add_(gw, lo_w, _product(g_in.t(), h, ws))
            first = False
            del g, g_in
        if need_w and exact and first:  # no rows at all
            gw.zero_()
    del ws, lo_h
    if grad_h is not None and sp is not None:
        grad_h = reduce_scatter_sequence(grad_h, *sp)
    return (None if grad_h is None else grad_h.to(hidden.dtype), grad_w,
            None if grad_b is None else grad_b.to(bias.dtype))


def gather_sequence(x2d: torch.Tensor, group, world: int) -> torch.Tensor:
    """``[n, H]`` rows of every rank of ``group`` concatenated in rank order, ``[world * n, H]`` (megatron's
    sequence-parallel all-gather along the first dimension of ``[s / tp, b, H]``, whose rows flatten in order)."""
    return all_gather(x2d.reshape(-1), group, world).view((world * x2d.shape[0],) + tuple(x2d.shape[1:]))


def reduce_scatter_sequence(x2d: torch.Tensor, group, world: int) -> torch.Tensor:
    """The sum over ``group`` of ``x2d`` ``[world * n, H]``, this rank's ``n`` rows of it (the reverse of
    :func:`gather_sequence`: megatron's reduce-scatter along the first dimension)."""
    out = x2d.new_empty((x2d.shape[0] // world,) + tuple(x2d.shape[1:]))
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(out, x2d.contiguous(), group=group)
    return out


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over the TP group (megatron-core's
    ``copy_to_tensor_model_parallel_region``: each rank's output-layer shard contributes part of d(loss)/d(hidden))."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def copy_to_tensor_parallel_region(x: torch.Tensor, tp_group) -> torch.Tensor:
    """``x`` unchanged, with its gradient summed over ``tp_group`` in backward (a no-op without TP)."""
    if tp_group is None or group_size_rank(tp_group)[0] == 1:
        return x
    return _CopyToTensorParallelRegion.apply(x, tp_group)


def _check_headers(records, group, world, vocab_size, n_rows, n_tiles) -> None:
    """check_group: one tiny all-gather of every record's 64-byte header, checked on the host per row chunk, so ranks
    with different row counts or layouts get a named error before the records' all-gather."""
    hl = LY.header_len(records[0].dtype)
    headers = torch.cat([r[:hl].clone().view(torch.int64) for r in records])
    per = headers.numel() // len(records)
    got = all_gather(headers, group, world).cpu().view(world, n_rows, n_tiles, per)
    for i in range(n_rows):
        why = LY.layout_error([got[r, i, j].tolist() for r in range(world) for j in range(n_tiles)],
                                     vocab_size, unit="shard")
        if why is not None:
            raise ValueError("linear_log_probs: the tensor-parallel shards do not fit together: " + why)


def linear_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    tp_group=None,
    *,
    bias: Optional[torch.Tensor] = None,
    vocab_start: Optional[int] = None,
    vocab_size: Optional[int] = None,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
    chunk_rows: Optional[int] = None,
    chunk_cols: Optional[int] = None,
    check_group: Optional[bool] = None,
    sequence_parallel: bool = False,
    batch_invariant: bool = False,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """``vocab_parallel_log_probs(hidden @ weight.T + bias, target, tp_group, ...)`` without the logits tensor.

    Args:
        hidden: ``[..., H]`` hidden states (megatron's ``[s, b, H]``), bf16/fp16/fp32/fp64.
        weight: this rank's output-layer shard ``[V_local, H]`` (``ColumnParallelLinear.weight``), hidden's dtype and
            device.
        target: **global** token ids ``hidden.shape[:-1]`` (int64 or int32), the same on every rank.
        tp_group: the tensor-parallel group the vocab is split over (None: ``weight`` is the whole vocab).
        bias: optional ``[V_local]`` bias of the output layer.
        vocab_start, vocab_size, temperature, ignore_index, return_entropy, check_group: as in
            :func:`~rollout_corr_ext.vocab_parallel_log_probs` (padded vocab rows of ``weight`` at or past
            ``vocab_size`` are excluded).
        chunk_rows, chunk_cols: the logits chunk computed at a time (default 2048 x 2048); larger chunks run the
            GEMM more efficiently, smaller ones use less memory. Results do not depend on them beyond float rounding
            of the gradient accumulation.
        sequence_parallel: ``hidden`` is this rank's piece of the sequence, as megatron's output layer receives it
            with sequence parallelism (``[s / tp, b, H]``, split along the first dimension over ``tp_group``), while
            ``target`` is the whole ``[s, b]``. The rows are all-gathered over ``tp_group`` in forward (and again in
            backward: only this rank's piece is kept for it, as megatron's layer does), and ``grad_hidden`` is
            reduce-scattered back, summed over the group's vocab shards: it is then the whole gradient of this
            rank's rows (no :func:`copy_to_tensor_parallel_region` around ``hidden``). The log-probs are those of
            the whole sequence, equal to the non-sequence-parallel call's.
        batch_invariant: a row's log-prob and entropy are bitwise the same whatever other rows share its batch,
            wherever it sits in it, and however many rows the loss ignores (on one device kind, at one thread
            count and tensor-parallel layout). Every GEMM then has the fixed shape ``[chunk_rows, H] x [H, tile]``
            (a chunk with fewer rows is padded with zero rows; ``chunk_rows`` defaults to
            ``BATCH_INVARIANT_CHUNK_ROWS`` = 256 here), so the GEMM's blocking and reduction order cannot depend on
            the batch; the rest of the path is per row already. Costs the padding of the last chunk (and of every
            chunk of a batch under ``chunk_rows``). The gradients are not batch-invariant (they sum over rows).

    Returns:
        fp32 log-probs ``hidden.shape[:-1]`` (fp64 for fp64 inputs), and the entropy when ``return_entropy``;
        differentiable with respect to ``hidden``, ``weight`` and ``bias``. One all-gather per forward under TP
        (plus the 64-byte header check when ``check_group``), none in backward; with ``sequence_parallel``, one
        all-gather of the hidden rows more in forward, and an all-gather and a reduce-scatter of them in backward.
    """
    a = prepare(hidden, weight, target, tp_group, bias, vocab_start, vocab_size, temperature, ignore_index,
                 chunk_rows, chunk_cols, check_group, sequence_parallel, batch_invariant)
    return_entropy = as_bool("return_entropy", return_entropy)
    logp, entropy = LinearLogProbs.apply(a.hidden2d, weight, bias, a.target1d, tp_group, a.world, a.vocab_start,
                                          a.vocab_size, a.inv_temp, a.ignore_index, a.chunk_rows, a.chunk_cols,
                                          a.check_group, None, a.sequence_parallel, None, a.batch_invariant)
    logp, entropy = logp.reshape(a.lead), entropy.reshape(a.lead)
    return (logp, entropy) if return_entropy else logp


class _Prepared(NamedTuple):
    hidden2d: torch.Tensor
    target1d: torch.Tensor
    lead: torch.Size
    world: int
    vocab_start: int
    vocab_size: int
    inv_temp: float
    ignore_index: int
    chunk_rows: int
    chunk_cols: int
    check_group: bool
    sequence_parallel: bool  # and world > 1: hidden2d holds this rank's rows, target1d the whole sequence's
    batch_invariant: bool


def prepare(hidden, weight, target, tp_group, bias, vocab_start, vocab_size, temperature, ignore_index, chunk_rows,
             chunk_cols, check_group, sequence_parallel=False, batch_invariant=False) -> _Prepared:
    """The boundary checks of :func:`linear_log_probs` (and of its sampling-replay sibling), named errors."""
    if not isinstance(hidden, torch.Tensor) or hidden.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"hidden must be a float16/bfloat16/float32/float64 tensor, got "
                        f"{getattr(hidden, 'dtype', type(hidden))}")
    if hidden.dim() < 1 or hidden.shape[-1] == 0:
        raise ValueError(f"hidden must have a non-empty last (hidden-size) dimension, got shape "
                         f"{tuple(hidden.shape)}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be the [V_local, H] output-layer shard, got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight)}")
    if weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise ValueError(f"weight must have shape [V_local > 0, H = hidden.shape[-1] = {hidden.shape[-1]}], got "
                         f"{tuple(weight.shape)}")
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(f"weight ({weight.dtype}, {weight.device}) must have hidden's dtype and device "
                         f"({hidden.dtype}, {hidden.device})")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must have shape [V_local] = ({weight.shape[0]},), got "
                             f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias)}")
        if bias.dtype != hidden.dtype or bias.device != hidden.device:
            raise ValueError(f"bias ({bias.dtype}, {bias.device}) must have hidden's dtype and device "
                             f"({hidden.dtype}, {hidden.device})")
    sequence_parallel = as_bool("sequence_parallel", sequence_parallel)
    world, rank = group_size_rank(tp_group)
    sp = sequence_parallel and world > 1
    if sp:
        if hidden.dim() < 2:
            raise ValueError(f"sequence_parallel: hidden must be this rank's [s / tp, ..., H] piece of the sequence, "
                             f"got shape {tuple(hidden.shape)}")
        whole = (hidden.shape[0] * world,) + tuple(hidden.shape[1:-1])
        if isinstance(target, torch.Tensor) and tuple(target.shape) != whole:
            raise ValueError(f"sequence_parallel: target must be the whole sequence's ids, shape (hidden.shape[0] * "
                             f"tp, *hidden.shape[1:-1]) = {whole} (tp = {world}), got {tuple(target.shape)}")
        check_target(target, hidden.new_empty(whole + (0,)), "the gathered hidden")
    else:
        check_target(target, hidden, "hidden")
    inv_temp = checked_inv_temperature(temperature, hidden.dtype)
    ignore_index = as_int("ignore_index", ignore_index)
    batch_invariant = as_bool("batch_invariant", batch_invariant)
    if chunk_rows is None:
        chunk_rows = BATCH_INVARIANT_CHUNK_ROWS if batch_invariant else DEFAULT_CHUNK_ROWS
    chunk_rows = as_int("chunk_rows", chunk_rows)
    chunk_cols = DEFAULT_CHUNK_COLS if chunk_cols is None else as_int("chunk_cols", chunk_cols)
    if chunk_rows < 1 or chunk_cols < 1:
        raise ValueError(f"chunk_rows and chunk_cols must be >= 1, got {chunk_rows} and {chunk_cols}")
    local_vocab = weight.shape[0]
    vocab_start, vocab_size = vocab_layout(vocab_start, vocab_size, rank, world, local_vocab)
    check_single_shard(world, vocab_start, vocab_size, local_vocab, "weight", "weight.shape[0]")
    check_group = (hidden.device.type == "cpu") if check_group is None else as_bool("check_group", check_group)

    return _Prepared(hidden.reshape(-1, hidden.shape[-1]), target.reshape(-1).to(torch.int64).contiguous(),
                     target.shape, world, vocab_start, vocab_size, inv_temp, ignore_index, chunk_rows, chunk_cols,
                     check_group, sp, batch_invariant)
