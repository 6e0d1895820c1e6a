"""``python -m megatron_rrfp.launch SCRIPT ...``: see ``megatron_rrfp.megatron_lm.launch``."""
from .megatron_lm.launch import main

if __name__ == "__main__":
    main()
