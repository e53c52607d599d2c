"""Test session setup: make sure the compiled kernels (not the pure-PyTorch fallback) are what runs.

With a prebuilt `rollout_corr_ext._C` (pip install) nothing happens. Without one, the extension is JIT-compiled
once (ROLLOUT_CORR_BUILD_DIR caches it). ROLLOUT_CORR_FORCE_FALLBACK=1 runs the suite on the fallback backend.
"""

import os
import sys
import warnings

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")

with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)
    import rollout_corr_ext  # noqa: E402
    from rollout_corr_ext import _env  # noqa: E402

if rollout_corr_ext.backend() == "fallback" and not _env.flag("ROLLOUT_CORR_FORCE_FALLBACK"):
    rollout_corr_ext.load_extension()


def pytest_report_header(config):
    return f"rollout_corr_ext backend: {rollout_corr_ext.backend()}"


@pytest.fixture(scope="session")
def compiled_backend():
    if rollout_corr_ext.backend() == "fallback":
        pytest.skip(reason="needs the compiled extension (ROLLOUT_CORR_FORCE_FALLBACK=1 is set)")
    return rollout_corr_ext.backend()


def pytest_collection_modifyitems(config, items):
    """Mark the megatron-facing tests (``-m megatron``: the second CI job runs them on the newest megatron-core):
    every test of a ``test_megatron_*`` file and of the demo, and every test whose id names megatron."""
    for item in items:
        name = os.path.basename(str(item.fspath))
        if name.startswith("test_megatron_") or name == "test_demo_smoke.py" or "megatron" in item.nodeid.lower():
            item.add_marker(pytest.mark.megatron)
    # The longest tests first (those marked slow, which build emulated kernels in subprocesses, and the benchmark and
    # demo runs): under pytest-xdist (scripts/test.sh) they then overlap the many short ones instead of running alone
    # at the end. A stable sort: every other test keeps its collection order.
    items.sort(key=lambda item: not (item.get_closest_marker("slow") is not None
                                     or os.path.basename(str(item.fspath)) in _LONG_FILES))


#: Files of subprocess runs (benchmarks, the demo under torchrun) that take 10-100 s each.
_LONG_FILES = ("test_benchmarks_smoke.py", "test_demo_smoke.py")
