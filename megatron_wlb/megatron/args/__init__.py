"""Megatron's arguments and ours: the typed view of Megatron's ``args`` (``megatron_args``), our ``--wlb-*`` flags
(``flags``) and the settings they give (``settings``), their checks (``validation``: the settings against Megatron's
flags; ``preflight``: the training flags against variable-length packing), the supported releases and the version
check (``version``), and what a process needs before it imports Megatron (``compat``).

The lowest sub-package: every other may import it. Importing the package runs nothing.
"""
