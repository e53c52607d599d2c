"""(logits, target, kwargs) sample cases of the log-prob op, shared by the CPU, CUDA and emulator tests."""

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
