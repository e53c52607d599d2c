"""Peak extra memory of one call as the user's process sees it (shared by the benchmarks that measure memory)."""

from __future__ import annotations


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def peak_extra_mib(fn, device: str) -> float:
    """MiB that ``fn()`` adds at its peak: CUDA, the allocator's peak above what is allocated now; CPU, the RSS
    high-water mark above the current RSS (the mark is reset first through /proc/self/clear_refs)."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    base = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    fn()
    return (_status_kib("VmHWM") - base) / 1024.0
