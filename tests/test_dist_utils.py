"""The spawned-worker launcher of the test support: a worker killed before it joined the process group (no test
code ran in it) starts the set again once, with a warning; a worker killed after joining fails the test."""

import pytest
import torch.multiprocessing as mp

from rollout_corr_testing import dist_utils


def _killed():
    return mp.ProcessExitedException("process 1 terminated with signal SIGABRT", error_index=1, error_pid=1,
                                     exit_code=-6, signal_name="SIGABRT")


def test_a_worker_killed_before_joining_is_started_again_once():
    calls = []

    def start(entry, args):
        calls.append(args[1])  # the store address: a fresh store per attempt
        if len(calls) == 1:
            raise _killed()

    with pytest.warns(UserWarning, match="before joining the process group"):
        dist_utils._launch(start, print, 2, (), "cpu")
    assert len(calls) == 2


def test_a_worker_killed_twice_or_after_joining_fails():
    def always(entry, args):
        raise _killed()

    with pytest.warns(UserWarning), pytest.raises(mp.ProcessExitedException):
        dist_utils._launch(always, print, 2, (), "cpu")

    def joined_then_killed(entry, args):
        import torch.distributed as dist

        host, port = args[1]
        client = dist.TCPStore(host, port, None, False)
        for r in range(2):
            client.set(f"joined/{r}", "1")
        raise _killed()

    with pytest.raises(mp.ProcessExitedException):
        dist_utils._launch(joined_then_killed, print, 2, (), "cpu")
