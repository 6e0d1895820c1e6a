"""``python -m megatron_rrfp`` = the ``megatron-rrfp`` command."""
import sys

from .cli import main

sys.exit(main())
