"""Imported first by the local launcher's fork server (``function._PRELOAD``): the server
imports megatron-core once for every rank it forks, so it must hide what a CLI command
hides (``megatron_rrfp.quiet``) before that import. A no-op outside a CLI command."""
from ..quiet import from_environment

from_environment()
