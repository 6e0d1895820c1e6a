"""Transformer Engine and the B/W split (BFW): what exists, and what is refused.

Transformer Engine (not installed on CPU hosts; nothing below is implemented or
tested). TE >= 2.3 splits the backward itself: its Linear / LayerNormLinear /
LayerNormMLP / GroupedLinear take ``delay_wgrad_compute=True`` at construction
(megatron-core passes ``config.delay_wgrad_compute`` through TELinear & co. and raises
for TE < 2.3). Each such module owns ``module.wgrad_store``
(transformer_engine.pytorch.module.base.WeightGradStore) with
``delay_wgrad_compute()`` / ``enable_delay_wgrad_compute()`` /
``disable_delay_wgrad_compute()``, a FIFO ``context`` queue filled by ``put`` in the
backward, and ``module.backward_dw()`` pops the *oldest* entry, computes wgrad/bgrad
and calls the hooks given to ``module.register_wgrad_accumulation_and_reduce_hooks``
(megatron-core DDP registers its post-hook there when ``ddp_config.delay_wgrad_compute``
and the parameter has ``skip_backward_post_hook``). A TE path for this store would:
in ``deferring(key)`` enable the stores of the key's modules and record which modules
queued an entry; in ``run(key)`` call ``backward_dw()`` on them — valid only if W runs
in the same order as B per module (FIFO), so ``run`` would have to reject keys that
are not the oldest pending one. Until that exists, ``install`` refuses TE modules with
delay_wgrad_compute on; TE modules without it compute all their gradients in B.
"""
from __future__ import annotations


def te_delay_wgrad_reason(module) -> str:
    """Why ``module`` cannot join the B/W split (empty when it can)."""
    store = getattr(module, "wgrad_store", None)  # Transformer Engine >= 2.3 modules
    if store is not None and callable(getattr(store, "delay_wgrad_compute", None)) and store.delay_wgrad_compute():
        return ("Transformer Engine delay_wgrad_compute is on: its weight gradients wait for module.backward_dw(), "
                "which this store does not call (see megatron_rrfp/mcore/wgrad_te.py)")
    return ""
