"""(logits, target, kwargs) sample cases of the log-prob op, shared by the CPU, CUDA and emulator tests."""

import math

import torch

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def sample_inputs(dtype, device="cpu", seed=0):
    """(logits, target, kwargs) cases: layouts, padding, temperature, ignore_index, tiny and ragged rows."""
    g = torch.Generator().manual_seed(seed)

    def make(shape, vocab_size=None, ignore=True, scale=3.0):
        logits = (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)
        v = shape[-1] if vocab_size is None else vocab_size
        target = torch.randint(0, v, shape[:-1], generator=g).to(device)
        if ignore and target.numel() > 2:
            target.view(-1)[1] = -100
        return logits, target

    yield (*make((7, 3, 129)), {})  # megatron [s, b, V]
    yield (*make((3, 7, 129)), {"temperature": 0.7})  # [b, s, V]
    yield (*make((5, 1000), vocab_size=997), {"vocab_size": 997})  # padded vocab
    yield (*make((4, 2, 64), ignore=False), {"temperature": 1.9})
    yield (*make((1, 1, 8)), {})  # a single token
    logits, target = make((6, 1531), ignore=False)
    target[4] = -1
    yield logits, target, {"ignore_index": -1}
    logits, target = make((4, 33), ignore=False)
    target[2] = 5
    yield logits, target, {"ignore_index": 5}  # ignore_index inside the vocab


def merge_stress_rows():
    """(logits fp64 [7, 20000], target) built to stress the CPU kernels' block merge: a max that keeps rising block
    after block (steep and slow ramps, and a falling one), a late jump, one finite logit, large logits, and a max
    towering over logits 80-95 nats below it among -inf columns (where the SIMD exp flushes to 0). 20000 columns:
    several blocks at every block width (2048 fp32 / fp16 columns, 8192 bf16)."""
    vocab = 20000
    ramp = torch.arange(vocab, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    late_jump = torch.randn(vocab, generator=g, dtype=torch.float64) * 3
    late_jump[-5] = 40.0
    one_hot = torch.full((vocab,), -math.inf, dtype=torch.float64)
    one_hot[100] = 1.0
    flush_edge = torch.linspace(-95.0, -80.0, vocab, dtype=torch.float64)
    flush_edge[::3] = -math.inf
    flush_edge[17] = 0.0
    rows = [ramp * 0.05, ramp * 1e-3, -ramp * 0.05, late_jump, one_hot,
            torch.randn(vocab, generator=g, dtype=torch.float64) * 3 + 1e4, flush_edge]
    return torch.stack(rows), torch.tensor([vocab - 1, 7, 0, vocab - 5, 100, 4321, 4000])
