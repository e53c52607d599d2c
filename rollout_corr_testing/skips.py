"""Skips that must not hide a broken CI: what a developer's machine may lack, CI installs and builds."""

import os

import pytest


def skip_unless_ci(reason: str) -> None:
    """Skip the test with ``reason``; under ``CI=true`` (where verl is installed and the extension is built) fail it
    with the same reason instead, so a missing dependency cannot pass as a skipped test there."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(reason)
    pytest.skip(reason=reason)


def verl_rollout_correction_fn():
    """verl 0.9.1's real ``compute_rollout_correction_and_rejection_mask``. Not importable (or another version):
    the test FAILS when CI=true, and is skipped with the reason otherwise."""
    try:
        import verl
        from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask
    except Exception as exc:  # noqa: BLE001 - any import failure means "verl is not usable here"
        skip_unless_ci(f"verl 0.9.1 (verl.trainer.ppo.rollout_corr_helper) cannot be imported: {exc!r}")
    if getattr(verl, "__version__", None) != "0.9.1":
        skip_unless_ci(f"the oracle follows verl 0.9.1; installed verl is {getattr(verl, '__version__', '?')}")
    return compute_rollout_correction_and_rejection_mask
