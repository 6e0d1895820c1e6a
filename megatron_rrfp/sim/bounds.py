"""Lower bounds on the makespan of one iteration (no schedule can beat them)."""
from __future__ import annotations

from ..policy.topology import Topology
from .variability import Realization


def lower_bound(realization: Realization, topology: Topology, num_microbatches: int,
                split_backward: bool = False) -> float:
    """LB = max_s [ sum_{i<s} min_j F_i^j + sum_j (F_s^j + B_s^j (+W_s^j)) + sum_{i<s} min_j B_i^j ].

    Stage s cannot start before the cheapest forward reached it, must run all its own work,
    and the last gradient must still travel back to stage 0. With a split backward the
    trip back only needs the input-gradient half B (W is off the critical path). Latency is
    ignored (it only lowers the bound). F_s^j / B_s^j sum over the stage's chunks.
    """
    forward_totals = [[sum(realization.forward[s][c][j] for c in range(topology.num_chunks))
                       for j in range(num_microbatches)] for s in range(topology.num_stages)]
    backward_totals = [[sum(realization.backward_total[s][c][j] for c in range(topology.num_chunks))
                        for j in range(num_microbatches)] for s in range(topology.num_stages)]
    best, head, tail = 0.0, 0.0, 0.0
    for s in range(topology.num_stages):
        best = max(best, head + sum(forward_totals[s]) + sum(backward_totals[s]) + tail)
        head += min(forward_totals[s])
        tail += min(backward_totals[s]) / (2 if split_backward else 1)
    return best
