"""Spawned multi-process tests: gloo on CPU, NCCL on GPUs.

``run_workers(fn, world_size, *args, device="cpu")`` starts ``world_size`` processes that join one process group (a
TCP store the parent serves on an OS-chosen port, so parallel runs never collide) and call
``fn(rank, world_size, *args)``.
``device="cpu"``: gloo, CPU tensors; ``device="cuda"``: NCCL, rank r on GPU r (:func:`worker_device` tells a worker
where its tensors go). :func:`dist_params` gives the two variants as pytest parameters, the NCCL one skipped with the
reason where fewer GPUs than ranks are visible. A worker that fails raises only after every rank has all-reduced a
failure flag, so no rank hangs in a collective waiting for a dead peer; the parent then re-raises the first worker's
traceback.
"""

from __future__ import annotations

import datetime
import os
import sys
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _ensure_backend():
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
    warnings.filterwarnings("ignore", category=RuntimeWarning, message="rollout_corr_ext.*")
    import rollout_corr_ext
    from rollout_corr_ext import _env

    if rollout_corr_ext.backend() == "fallback" and not _env.flag("ROLLOUT_CORR_FORCE_FALLBACK"):
        rollout_corr_ext.load_extension()


#: The device of this worker's tensors ("cpu" with gloo, "cuda:<rank>" with NCCL); set by the worker entry point.
_WORKER_DEVICE = ["cpu"]


def worker_device() -> torch.device:
    """Where a worker started by :func:`run_workers` keeps its tensors (its GPU under NCCL, else the CPU)."""
    return torch.device(_WORKER_DEVICE[0])


def dist_backend(device: str) -> str:
    """The process-group backend of a device variant: NCCL for "cuda", gloo for "cpu"."""
    return "nccl" if device == "cuda" else "gloo"


def dist_skip_reason(device: str, world_size: int):
    """Why ``world_size`` ranks on ``device`` cannot run here (None when they can): NCCL needs one GPU per rank and
    the extension built with its CUDA kernels."""
    if device != "cuda":
        return None
    import rollout_corr_ext

    if not torch.cuda.is_available():
        return "NCCL variant: needs CUDA GPUs (none visible)"
    if not dist.is_nccl_available():
        return "NCCL variant: this torch build has no NCCL"
    if rollout_corr_ext.backend() != "cuda":
        return "NCCL variant: needs the extension built with its CUDA kernels"
    if torch.cuda.device_count() < world_size:
        return f"NCCL variant: needs {world_size} GPUs (one per rank), {torch.cuda.device_count()} visible"
    return None


def dist_params(world_size: int, cuda_reason: str = None) -> list:
    """pytest parameters "cpu" (gloo, id ``gloo``) and "cuda" (NCCL, id ``nccl``: skipped with the reason unless
    ``world_size`` GPUs are visible; marked ``cuda``). ``cuda_reason``: the NCCL variant is skipped on every machine
    with that reason (a check that is an asynchronous device assert on CUDA)."""
    import pytest

    out = []
    for device in ("cpu", "cuda"):
        reason = dist_skip_reason(device, world_size)
        if device == "cuda" and cuda_reason:
            reason = f"NCCL variant: {cuda_reason}"
        marks = [pytest.mark.skip(reason=reason)] if reason else []
        if device == "cuda":
            marks.append(pytest.mark.cuda)
        out.append(pytest.param(device, marks=marks, id="nccl" if device == "cuda" else "gloo"))
    return out


def init_worker_group(rank: int, world_size: int, device: str, **init_kwargs) -> torch.device:
    """Join the process group of ``device`` ("cpu": gloo; "cuda": NCCL with this rank on GPU ``rank``) and return the
    device of this worker's tensors. ``init_kwargs`` go to ``init_process_group`` (init_method, timeout, ...)."""
    if device == "cuda":
        local = torch.device("cuda", rank)
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=local, **init_kwargs)
    else:
        local = torch.device("cpu")
        dist.init_process_group("gloo", rank=rank, world_size=world_size, **init_kwargs)
    _WORKER_DEVICE[0] = str(local)
    return local


def _entry(rank, world_size, address, fn, args, device="cpu"):
    import faulthandler

    faulthandler.enable()  # a worker that aborts (SIGABRT from C++) prints its Python stack
    torch.set_num_threads(1)
    host, port = address
    store = dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=300))
    # a collective one rank never joins (a test that fails on one rank between collectives) fails after 5 minutes
    # instead of hanging the suite at the backend's 30-minute default
    local = init_worker_group(rank, world_size, device, store=store, timeout=datetime.timedelta(seconds=300))
    store.set(f"joined/{rank}", "1")  # from here on a failure is the test's, never retried
    error = None
    try:
        _ensure_backend()
        fn(rank, world_size, *args)
    except BaseException:  # noqa: BLE001 - reported after the agreement below
        error = traceback.format_exc()
    flag = torch.tensor([1.0 if error else 0.0], device=local)
    dist.all_reduce(flag)
    dist.destroy_process_group()
    if error:
        raise AssertionError(f"rank {rank} failed:\n{error}")
    if flag.item() > 0:
        raise AssertionError(f"rank {rank}: another rank failed")
    # Every rank passed: leave without the interpreter's teardown. A worker that imported megatron-core aborts now
    # and then in its static destructors, after all of its work ("terminate called without an active exception",
    # no Python frame on the stack: measured 2 in 12 runs of one test), which the parent would report as a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _launch(start, fn, world_size: int, args, device: str) -> None:
    """Start the workers around a TCP store this process serves (an OS-chosen port: parallel runs never collide). A
    worker killed by a signal before it joined the process group (no test code has run in it yet) starts the whole
    set once more, with a warning: on a starved machine the process-group bring-up has aborted a worker
    ("terminate called without an active exception") before any of our code ran."""
    for attempt in (1, 2):
        store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=300))
        try:
            start(_entry, (world_size, ("127.0.0.1", store.port), fn, args, device))
            return
        except mp.ProcessExitedException as exc:
            joined = store.check([f"joined/{r}" for r in range(world_size)])
            if attempt == 2 or joined:
                raise
            warnings.warn(f"a worker died before joining the process group ({exc}); starting the workers again")
        finally:
            del store


def run_workers(fn, world_size: int, *args, device: str = "cpu") -> None:
    _launch(lambda entry, a: mp.spawn(entry, args=a, nprocs=world_size, join=True), fn, world_size, args, device)


def run_workers_preloaded(fn, world_size: int, *args, preload=("megatron.core",), device: str = "cpu") -> None:
    """:func:`run_workers` with the "forkserver" start method: ``preload`` is imported once in the fork server
    (which never runs torch work, so forking it is safe) and every worker starts with it imported. megatron-core
    takes 15-25 s to import on a loaded 2-core machine; spawned workers would each pay that. ``device="cuda"``
    spawns instead: the fork server's imports ask torch about CUDA, and a CUDA runtime must not be forked."""
    if device == "cuda":
        run_workers(fn, world_size, *args, device=device)
        return
    import multiprocessing

    multiprocessing.set_forkserver_preload(list(preload) + ["rollout_corr_ext"])  # ignored if the server runs
    _launch(lambda entry, a: mp.start_processes(entry, args=a, nprocs=world_size, join=True,
                                                start_method="forkserver"), fn, world_size, args, device)


class CollectiveCounter:
    """Counts calls of torch.distributed collectives while active (they are looked up on the module at call time)."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter", "reduce_scatter_tensor",
             "reduce_scatter_single",
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
