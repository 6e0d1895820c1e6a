"""Helpers for tests: a multi-process gloo launcher with megatron-core parallel state."""
from megatron_rrfp.testing.launcher import DistributedTestFailure, RankOutcome, launch

__all__ = ["DistributedTestFailure", "RankOutcome", "launch"]
