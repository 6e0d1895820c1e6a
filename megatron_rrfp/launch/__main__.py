"""``python -m megatron_rrfp.launch [--cpu] SCRIPT ...``: a Megatron-LM entry script with megatron-rrfp
installed (``megatron_lm.py``)."""
from .megatron_lm import main

main()
