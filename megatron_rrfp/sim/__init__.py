"""The simulator: the policy's dry run under sampled run-time variability, lower bounds,
and the `megatron-rrfp simulate` study."""
from .bounds import lower_bound
from .simulator import BASELINE, DeadlockError, SimResult, median, policy, simulate
from .variability import REFERENCE_J3, VARIABILITY_LEVELS, Realization, Variability, sample_realization

__all__ = ["BASELINE", "REFERENCE_J3", "VARIABILITY_LEVELS", "DeadlockError", "Realization", "SimResult",
           "Variability", "lower_bound", "median", "policy", "sample_realization", "simulate"]
