"""Skips that must not hide a broken CI: what a developer's machine may lack, CI installs and builds."""

import os

import pytest


def skip_unless_ci(reason: str) -> None:
    """Skip the test with ``reason``; under ``CI=true`` (where verl is installed and the extension is built) fail it
    with the same reason instead, so a missing dependency cannot pass as a skipped test there."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(reason)
    pytest.skip(reason=reason)
