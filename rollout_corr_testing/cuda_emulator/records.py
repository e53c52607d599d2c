"""What the emulator's instruments saw (cuda_emu.h): global traffic, sectors per request, barrier releases and
racecheck hazards of every launch, read back from ``torch.ops.rollout_corr_emu.launch_records``.

    with recorded_launches() as rec:
        record = emu.vocab_row_stats(logits, target, ...)
    stats, = rec.launches("vocab_row_stats_kernel", logits=logits, record=record)
    stats.buffers["logits"].read_bytes, stats.read.sectors / stats.read.requests, stats.hazards

Buffers are named when read, since the outputs of an op exist only after the call; every access outside the
named buffers (scratch the op keeps to itself, an output left unnamed) is counted in ``other``.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional

import torch


@dataclass
class Direction:
    """Loads or stores of one launch."""

    accesses: int  # lane-level accesses
    bytes: int  # lane-level bytes
    unique_bytes: int  # distinct bytes (what a perfect cache would move)
    requests: int  # warp-level requests
    sectors: int  # distinct 32-byte sectors per request, summed
    ideal_sectors: int  # ceil(distinct bytes of the request / 32), summed (Nsight Compute's ideal)
    min_sectors: int  # the sectors a gapless request spans given its alignment (else the ideal), summed
    unique_sectors: int  # distinct sectors over the launch (the DRAM traffic with a perfect cache)

    @property
    def sectors_per_request(self) -> float:
        return self.sectors / self.requests if self.requests else 0.0

    @property
    def ideal_sectors_per_request(self) -> float:
        return self.ideal_sectors / self.requests if self.requests else 0.0


@dataclass
class Sectors:
    """Warp-level requests and the sectors they touched."""

    requests: int
    sectors: int
    ideal_sectors: int
    min_sectors: int

    @property
    def per_request(self) -> float:
        return self.sectors / self.requests if self.requests else 0.0


@dataclass
class Site:
    file: str
    line: int
    store: bool
    accesses: int
    bytes: int
    requests: int
    sectors: int
    ideal_sectors: int
    min_sectors: int

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass
class BufferTraffic:
    read_bytes: int
    read_unique: int
    read_max: int  # most reads of one byte
    write_bytes: int
    write_unique: int
    write_max: int
    read_sectors: Sectors  # the parts of the requests that fell in this buffer
    write_sectors: Sectors


@dataclass
class LaunchStats:
    kernel: str
    grid: List[int]
    block: List[int]
    read: Direction
    write: Direction
    sites: List[Site]
    buffers: Dict[str, BufferTraffic]
    other_read_bytes: int
    other_write_bytes: int
    barriers: Dict[str, int]  # "file:line" of a __syncthreads -> releases
    hazard_count: int
    hazards: List[str] = field(default_factory=list)

    @property
    def uncoalesced_sites(self) -> List[Site]:
        """Sites whose requests touched more sectors than their bytes' alignment requires."""
        return [s for s in self.sites if s.sectors != s.min_sectors]


class LaunchLog:
    def launches(self, kernel: Optional[str] = None, **buffers: torch.Tensor) -> List[LaunchStats]:
        """The recorded launches (those whose kernel name contains ``kernel``), with the named buffers' traffic."""
        names = list(buffers)
        raw = json.loads(torch.ops.rollout_corr_emu.launch_records([buffers[n] for n in names]))
        out = []
        for r in raw:
            if kernel is not None and kernel not in r["kernel"]:
                continue
            out.append(LaunchStats(
                kernel=r["kernel"], grid=r["grid"], block=r["block"], read=Direction(**r["read"]),
                write=Direction(**r["write"]), sites=[Site(**s) for s in r["sites"]],
                buffers={n: _buffer(b) for n, b in zip(names, r["buffers"])},
                other_read_bytes=r["other"]["read_bytes"], other_write_bytes=r["other"]["write_bytes"],
                barriers=r["barriers"], hazard_count=r["hazard_count"], hazards=r["hazards"]))
        return out


def _buffer(b) -> BufferTraffic:
    b = dict(b)
    b["read_sectors"] = Sectors(**b["read_sectors"])
    b["write_sectors"] = Sectors(**b["write_sectors"])
    return BufferTraffic(**b)


@contextmanager
def recorded_launches() -> Iterator[LaunchLog]:
    """Record every emulated launch in the block (the records stay readable after it, until the next one)."""
    ops = torch.ops.rollout_corr_emu
    ops.record_start()
    try:
        yield LaunchLog()
    finally:
        ops.record_stop()


@contextmanager
def racecheck(mode: int) -> Iterator[None]:
    """racecheck in the block: 0 off, 1 record hazards only, 2 record and fail the launch (the default)."""
    old = torch.ops.rollout_corr_emu.set_racecheck(mode)
    try:
        yield
    finally:
        torch.ops.rollout_corr_emu.set_racecheck(old)


def racecheck_available() -> bool:
    return bool(torch.ops.rollout_corr_emu.racecheck_available())
