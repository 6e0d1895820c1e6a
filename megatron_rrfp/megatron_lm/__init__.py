"""Megatron-LM (``megatron.training``) without edits: ``install()`` adds the
--pipeline-schedule / --rrfp-* flags (``flags.py``) and routes the schedule lookup
(``install.py``); ``launch.py`` runs unmodified entry scripts (``--cpu`` on hosts without
CUDA, ``megatron_rrfp.cpu``); ``hooks.py`` fills the goodput ledger and traces around its
training loop; ``hookpoints.py`` is the one place that knows its module layout.

Nothing is imported here: the launcher must put the entry script's directory on
``sys.path`` before anything imports ``megatron``.
"""
