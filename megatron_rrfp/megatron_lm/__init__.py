"""Megatron-LM (``megatron.training``) without edits: ``install()`` adds the
--pipeline-schedule / --rrfp-* flags (``flags.py``) and routes the schedule lookup
(``install.py``); ``training_loop.py`` fills Megatron's timers, the goodput ledger and traces
around its training loop; ``layout.py`` is the one place that knows its module layout and names,
by release. Unmodified entry scripts run through ``python -m megatron_rrfp.launch`` (``--cpu`` on
hosts without CUDA, ``megatron_rrfp.cpu``).

Nothing is imported here: the launcher must put the entry script's directory on
``sys.path`` before anything imports ``megatron``.
"""
