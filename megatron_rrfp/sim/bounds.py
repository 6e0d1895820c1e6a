"""Lower bounds on the makespan of one iteration (no schedule can beat them)."""
from __future__ import annotations

import statistics
from collections.abc import Sequence

from ..policy.arbiter import ArbiterConfig
from ..policy.plan import Plan
from ..policy.topology import Topology
from .variability import Realization


def lower_bound(realization: Realization, topology: Topology, num_microbatches: int,
                split_backward: bool = False) -> float:
    """A makespan no schedule can beat on this realisation, in the realisation's unit (f0).

    With F[s][c][j], B[s][c][j] the forward and full-backward times of chunk c of stage s
    for microbatch j, b = B/2 the input-gradient half when the backward is split (else
    b = B), and for each stage s:

      head_s    = sum_{i<s} min_j F[i][0][j]         no task of s starts before some
                                                     chunk-0 forward crossed stages 0..s-1
      work_s    = sum_{c,j} (F + B)[s][c][j]         s runs all its work, one task at a time
      crit_s    = sum_{c,j} (F + b)[s][c][j]         ... of which this precedes its last B
      tail_s(c) = sum_{i<s} min_j b[i][c][j] + sum_{c'<c} sum_i min_j b[i][c'][j]
                                                     the gradient of a chunk-c B on s still
                                                     has to cross every lower virtual stage

      LB = max_s [ head_s + max(work_s, crit_s + min_c tail_s(c)) ]

    The tail follows the *last B*, not the last task: with a split backward, W may run
    while the gradient travels upstream. Latency is taken as 0 (it can only add).
    """
    pp, chunks = topology.num_stages, topology.num_chunks
    fwd, bwd = realization.forward, realization.backward_total
    half = 0.5 if split_backward else 1.0
    min_input_grad = [[half * min(bwd[s][c]) for c in range(chunks)] for s in range(pp)]
    best = head = 0.0
    for s in range(pp):
        forward = sum(sum(fwd[s][c]) for c in range(chunks))
        backward = sum(sum(bwd[s][c]) for c in range(chunks))
        tail = min(sum(min_input_grad[i][c] for i in range(s))
                   + sum(min_input_grad[i][lower] for lower in range(c) for i in range(pp))
                   for c in range(chunks))
        best = max(best, head + max(forward + backward, forward + half * backward + tail))
        head += min(fwd[s][0])
    return best


def median_lower_bound(config: ArbiterConfig, topology: Topology, realizations: Sequence[Realization]) -> float:
    """The median over realisations of the bound for the policy ``config`` runs (a split
    backward or not, as its plan says): what `bench` divides its measured times by."""
    m = len(realizations[0].forward[0][0])
    split = Plan.build(config, topology, m).split_backward
    return statistics.median(lower_bound(r, topology, m, split_backward=split) for r in realizations)
