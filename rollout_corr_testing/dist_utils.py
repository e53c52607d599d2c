"""Spawned multi-process tests with gloo on CPU.

``run_workers(fn, world_size, *args)`` starts ``world_size`` processes that join one gloo group (a file store
in a temp folder, so parallel runs never collide on a port) and call ``fn(rank, world_size, *args)``. A worker
that fails raises only after every rank has all-reduced a failure flag, so no rank hangs in a collective
waiting for a dead peer; the parent then re-raises the first worker's traceback.
"""

from __future__ import annotations

import os
import tempfile
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _ensure_backend():
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
    warnings.filterwarnings("ignore", category=RuntimeWarning, message="rollout_corr_ext.*")
    import rollout_corr_ext

    if rollout_corr_ext.backend() == "reference" and os.environ.get("ROLLOUT_CORR_FORCE_REFERENCE", "0") != "1":
        rollout_corr_ext.load_extension()


def _entry(rank, world_size, store_path, fn, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    error = None
    try:
        _ensure_backend()
        fn(rank, world_size, *args)
    except BaseException:  # noqa: BLE001 - reported after the agreement below
        error = traceback.format_exc()
    flag = torch.tensor([1.0 if error else 0.0])
    dist.all_reduce(flag)
    dist.destroy_process_group()
    if error:
        raise AssertionError(f"rank {rank} failed:\n{error}")
    if flag.item() > 0:
        raise AssertionError(f"rank {rank}: another rank failed")


def run_workers(fn, world_size: int, *args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.spawn(_entry, args=(world_size, store, fn, args), nprocs=world_size, join=True)


def run_workers_preloaded(fn, world_size: int, *args, preload=("megatron.core",)) -> None:
    """:func:`run_workers` with the "forkserver" start method: ``preload`` is imported once in the fork server
    (which never runs torch work, so forking it is safe) and every worker starts with it imported. megatron-core
    takes 15-25 s to import on a loaded 2-core machine; spawned workers would each pay that."""
    import multiprocessing

    multiprocessing.set_forkserver_preload(list(preload) + ["rollout_corr_ext"])  # ignored if the server runs
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.start_processes(_entry, args=(world_size, store, fn, args), nprocs=world_size, join=True,
                           start_method="forkserver")


class CollectiveCounter:
    """Counts calls of torch.distributed collectives while active (they are looked up on the module at call time)."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter", "reduce_scatter_tensor",
             "broadcast", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter")

    def __init__(self):
        self.calls = []
        self._saved = {}

    def __enter__(self):
        for name in self.NAMES:
            if not hasattr(dist, name):
                continue
            orig = getattr(dist, name)
            self._saved[name] = orig

            def wrapper(*a, __orig=orig, __name=name, **k):
                self.calls.append(__name)
                return __orig(*a, **k)

            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, orig in self._saved.items():
            setattr(dist, name, orig)
        return False


def cp_token_index(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The sequence positions megatron-core's context parallelism gives ``cp_rank``: the sequence is cut into
    ``2 * cp_size`` equal chunks and rank r holds chunks r and 2 * cp_size - 1 - r (the load-balanced layout of
    megatron's ``get_batch_on_this_cp_rank``, so causal-attention work is even)."""
    if seq_len % (2 * cp_size):
        raise ValueError(f"seq_len {seq_len} must be divisible by 2 * cp_size = {2 * cp_size}")
    chunk = seq_len // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk)
    return torch.cat([first, second])
