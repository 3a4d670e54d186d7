"""The run's state, beyond Megatron's own: ``process`` (``Runtime``: what ``apply()`` installed in this process),
the checkpoint sidecar (``checkpoint``, ``checkpoint_files``), the plan and start-up agreement (``agreement``), step
timing (``timing``, ``clocks``, ``recording``), the online cost-model refit (``online``) and the packing metrics
written through Megatron's logger (``wlb_logging``).

Above ``args`` and ``data``, below ``hooks`` and ``entry``. Importing the package runs nothing.
"""
