"""``python -m megatron_rrfp.train`` (what torchrun / srun / ``--nproc`` start per rank)."""
import sys

from .driver import main

sys.exit(main())
