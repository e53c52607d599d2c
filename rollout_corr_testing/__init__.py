"""Test support for rollout_corr_ext: the CUDA thread-model emulator, the tolerance table, spawned gloo workers
and shared inputs. A package of its own (not ``tests``): verl's wheel ships a top-level ``tests`` package, and a
regular package of that name would shadow ours. Not part of the installed wheel; the test suite puts the
repository root on ``sys.path``.
"""
