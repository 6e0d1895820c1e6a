"""`megatron-rrfp train`: a small GPT / multimodal pretraining driver on megatron-core that
any pipeline schedule can drive. ``driver.py`` (parse -> build -> run -> close),
``config.py`` (the flags, one dataclass), ``builders.py`` (model, optimizer, schedule,
data, goodput recorder), ``models.py``, ``data.py``, ``checkpoint.py``, ``recipes/``."""
