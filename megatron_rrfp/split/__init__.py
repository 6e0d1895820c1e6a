"""The B/W split: a stage's backward as I (input gradients, what the upstream stage waits for)
and W (weight gradients, deferred), the way torch's pipelining splits ``stage_backward_input``
from ``stage_backward_weight``. One module per part:

  megatron_linear  megatron-core's own linear layers: ``install(models)`` once, then B under
                   ``WeightGradStore.deferring(key)`` and W as ``store.run(key)``
  capture          how B calls megatron-core's linear backward with only its weight-gradient
                   GEMM intercepted (wrapped, not re-implemented)
  store            the deferred work per (microbatch, chunk), which modules can join, DDP owners
  te               Transformer Engine layers: TE's own deferral, driven by the W task
  coverage         which parameters get their gradient in W and which in B
"""
