"""Planning and audit tools that read a config's resolved run without training it: model size and memory
(``info.py`` over ``memory_planner.py``), the communication of a compiled step beside Megatron's minimum
(``comm_minimum.py``, ``comm_budget.py``, ``comm_report.py``), and the step-time model of a cluster
(``scaling.py``). Their commands are ``python -m megajax.info``, ``megajax.comm_report`` and ``megajax.scaling``."""
