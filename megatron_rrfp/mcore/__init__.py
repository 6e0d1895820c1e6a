"""Megatron-core's schedule contract: ``forward_backward_rrfp`` and what it needs from
megatron-core — version differences in ``compat.py`` (its CPU stand-ins are ``megatron_rrfp.cpu``),
gradient-sync rules in ``grad_sync.py`` (the B/W split of its linears is ``megatron_rrfp.split``),
the per-process transport and groups in ``session.py``.

Import the modules themselves (``megatron_rrfp.mcore.schedule``); this package file
imports nothing, so reading ``mcore.config`` never pulls in megatron-core early.
"""
