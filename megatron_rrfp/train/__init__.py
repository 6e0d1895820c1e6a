"""`megatron-rrfp train`: a small GPT / multimodal pretraining driver on megatron-core that
any pipeline schedule can drive. ``driver.py`` (parse -> build -> run -> close),
``config.py`` (the flags, one dataclass), ``builders.py`` (model, optimizer, schedule,
data, goodput recorder), ``models.py``, ``data.py`` (synthetic or Megatron indexed
datasets), ``checkpoint.py`` / ``checkpoint_dist.py`` (--ckpt-format torch / torch_dist),
``metrics.py`` (Megatron-LM's log line, TensorBoard, W&B, timers), ``signals.py`` (SIGTERM
grace, save-and-exit signal), ``recipes/``."""
