"""The pure-PyTorch implementation of every op: what runs when the compiled extension is not built
(``backend() == "fallback"``) and for devices the build has no kernels for.

Every function mirrors the contract of the ``torch.ops.rollout_corr.*`` op of the same name (same arguments, same
outputs, same dtypes); :mod:`rollout_corr_ext.ops` picks between the two and is the only package module that imports
this one. One module per op family, named after the family's stem in ``csrc/`` (``logprob``, ``rollout_correction``,
``policy_loss``, ``sampling``, ``linear``). Production code only: the test oracles live in ``rollout_corr_testing`` and share nothing with
this package or the kernels.
"""

from .linear import hilo_add_, mm_f32_
from .logprob import (logprob_backward, logprob_backward_, merge_row_stats, settings_fingerprint,
                      target_fingerprint, vocab_row_stats)
from .policy_loss import policy_loss_rows
from .rollout_correction import rollout_check, rollout_seq_stats, rollout_token_pass
from .sampling import (candidate_decide, count_at_least, floor_fill, floor_zero_, mass_histogram, row_candidates, row_topk,
                       scatter_rows)

__all__ = ["vocab_row_stats", "merge_row_stats", "logprob_backward", "logprob_backward_", "target_fingerprint",
           "settings_fingerprint", "rollout_seq_stats", "rollout_token_pass", "rollout_check", "policy_loss_rows",
           "row_topk", "floor_fill", "mass_histogram", "count_at_least",
           "floor_zero_", "row_candidates", "scatter_rows", "candidate_decide", "mm_f32_", "hilo_add_"]
