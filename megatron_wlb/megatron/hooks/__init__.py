"""The Megatron functions we replace: ``table`` (``HOOKS``: each one, where it lives, the releases it applies to,
and its installer), ``rebind`` (rebinding a function in every module that imported it), and the replacements that
belong to no other concern: the training loop's (``training_hooks``), the CP batch and its params (``cp_hooks``),
core attention (``attention``), RoPE and the rotary table (``rope``), pipeline shape exchange (``p2p``), the
start-up builds (``startup``), and Megatron-LM main's own packing path (``main_schedule``, ``main_checks``, their
shared ``main_names``).

Above ``args``, ``data`` and ``state``, below ``entry``. Importing the package runs nothing.
"""
