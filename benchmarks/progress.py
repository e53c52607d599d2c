"""The benchmarks' progress bar (shared): tqdm on their long loops (repeats, sizes), as the demo's. There is none
with ``--no-progress``, when stdout is not a terminal (a table piped to a file stays clean) or when tqdm is not
installed (it is optional: the benchmarks run without it). Rows printed while a bar is up go through ``bar.write``,
which keeps them clear of the bar."""

from __future__ import annotations

import argparse
import sys

HELP = ("no tqdm progress bar (there is none either when stdout is not a terminal or tqdm is not installed) "
        "(default: %(default)s)")


def add_progress_flag(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--no-progress", action="store_true", default=False, help=HELP)


class NoBar:
    """What :func:`progress_bar` returns when there is no bar: the calls the benchmarks make, doing nothing
    (``write`` prints)."""

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass

    @staticmethod
    def write(s: str) -> None:
        print(s, flush=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def progress_bar(total: int, desc: str, disable: bool = False, unit: str = "run"):
    """A tqdm bar of ``total`` steps (gone once closed: the tables stay as they print), or a :class:`NoBar`."""
    if disable or not sys.stdout.isatty():
        return NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return NoBar()
    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, leave=False)
