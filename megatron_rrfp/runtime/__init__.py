"""The runtime of one pipeline rank: the readiness-first loop (``executor.py``), the
message-driven transport between stages (``transport.py``), the tensor-parallel agreement
(``agreement.py``) and what a rank measured in one iteration (``report.py``).

Framework-agnostic: Megatron-core plugs in through ``mcore/``. Import the modules
themselves; this file imports nothing (``report.py`` is torch-free).
"""
