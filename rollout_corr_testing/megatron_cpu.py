"""megatron-core's own ``GPTModel`` (the local, non-TransformerEngine layer spec) on CPU with gloo, for the tests and
the demo. Measured on megatron-core 0.16.1 (torch 2.14.1, no GPU), these are the pieces that need CUDA or refuse
this configuration, each with the smallest shim that lets the rest run unmodified:

1. Sequence parallelism allocates on ``torch.cuda.current_device()``:
   ``tensor_parallel.mappings._gather_along_first_dim`` / ``_reduce_scatter_along_first_dim`` (and
   ``_gather_along_last_dim``), the SP backward of ``tensor_parallel.layers.LinearWithGradAccumulationAndAsync
   Communication`` and ``utils.GlobalMemoryBuffer.get_tensor``. Shim: ``torch.cuda.current_device`` answers
   ``"cpu"`` while :func:`cpu_megatron` is active (same collectives, host buffers).
2. The model-parallel RNG tracker (``tensor_parallel.random.CudaRNGStatesTracker``) keeps ``torch.cuda`` RNG states:
   ``model_parallel_cuda_manual_seed`` and every ``fork()`` (embedding and attention dropout) need CUDA. Shim: with
   dropout 0 (required here) ``fork()`` is a no-op context.
3. ``transformer.torch_norm.WrappedTorchNorm`` (the local spec's norm without Apex / TE) refuses
   ``sequence_parallel=True``. Replacement: :class:`SequenceParallelLayerNorm`, a torch LayerNorm whose parameters
   carry ``sequence_parallel = True`` as megatron's own norms do; their gradients are then partial per TP rank and
   summed over TP by :func:`allreduce_sequence_parallel_grads` (what ``finalize_model_grads`` does on GPUs).
4. The local attention's default causal mask is built on ``"cuda"`` (``transformer.utils.get_default_causal_mask``,
   used when ``attention_mask`` is None): pass :func:`causal_mask` instead.
5. ``pipeline_parallel.schedules.forward_backward_no_pipelining`` allocates ``total_num_tokens`` on ``"cuda"``: the
   ``loss_func`` is called directly, in the same contract (``loss_sum / num_tokens``, then backward).

Everything else (``GPTModel``, ``TransformerBlock``, ``TransformerLayer``, ``SelfAttention`` with
``DotProductAttention``, ``MLP``, the TP linears, ``VocabParallelEmbedding``, RoPE, the vocab-parallel output
layer with SP) is megatron-core's, unmodified.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` in megatron's norm signature, with ``sequence_parallel`` marked on its parameters."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        for p in self.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)


@contextlib.contextmanager
def cpu_megatron():
    """Shims 1 and 2 of the module docstring, undone on exit."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    saved_device, saved_fork = torch.cuda.current_device, tracker.__dict__.get("fork")
    torch.cuda.current_device = lambda: "cpu"
    tracker.fork = lambda *a, **k: contextlib.nullcontext()
    try:
        yield
    finally:
        torch.cuda.current_device = saved_device
        if saved_fork is None:
            del tracker.fork
        else:
            tracker.fork = saved_fork


def gpt_model(vocab_size: int, *, tp: int, sequence_parallel: bool, hidden: int = 32, heads: int = 4,
              layers: int = 2, ffn: int = 64, max_len: int = 64, seed: int = 0, dtype=torch.float32,
              share_embeddings: bool = False):
    """megatron-core's ``GPTModel`` with the local layer spec (RoPE, causal self-attention, GeLU MLP), its layer
    norms :class:`SequenceParallelLayerNorm`, dropout 0 and CPU initialization: with the same ``seed`` every TP size
    initializes the same full weights (megatron initializes each master weight on CPU, then splits it)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    spec = get_gpt_layer_local_spec()
    spec.submodules.input_layernorm = SequenceParallelLayerNorm
    spec.submodules.pre_mlp_layernorm = SequenceParallelLayerNorm
    block = TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=SequenceParallelLayerNorm)
    cfg = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=ffn,
                            tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel and tp > 1,
                            use_cpu_initialization=True, perform_initialization=True, params_dtype=dtype,
                            hidden_dropout=0.0, attention_dropout=0.0, bf16=dtype == torch.bfloat16)
    torch.manual_seed(seed)
    return GPTModel(config=cfg, transformer_layer_spec=block, vocab_size=vocab_size, max_sequence_length=max_len,
                    position_embedding_type="rope", share_embeddings_and_output_weights=share_embeddings)


def causal_mask(seq_len: int, device=None) -> torch.Tensor:
    """megatron's attention mask for causal self-attention (True = masked), ``[1, 1, s, s]``, on ``device``."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), 1)[None, None]


@contextlib.contextmanager
def final_hidden_states(model):
    """Within the block ``model(...)`` returns the decoder's output after its final norm (``[s, b, H]``; with
    sequence parallelism this rank's ``[s / tp, b, H]``), i.e. the output layer's input, instead of the logits:
    ``GPTModel`` returns its hidden states when it is not the post-process stage, while the decoder keeps its
    final norm."""
    saved = model.post_process
    model.post_process = False
    try:
        yield
    finally:
        model.post_process = saved


def allreduce_sequence_parallel_grads(model, tp_group) -> None:
    """Sum over TP the gradients of the parameters marked ``sequence_parallel`` (the norms: each rank saw only its
    piece of the sequence), as megatron's ``finalize_model_grads`` does."""
    for p in model.parameters():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            dist.all_reduce(p.grad, group=tp_group)
