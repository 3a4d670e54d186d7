"""The ways into a training run: ``launcher`` (a thin ``pretrain_gpt`` over Megatron's own ``pretrain``, ``python -m
megatron_wlb.megatron.entry.launcher``), its steps and providers (``gpt_entry``), and the CPU harness (``cpu``:
Megatron's loop on gloo, ``cpu_redirects``: the CUDA calls it redirects). A patched checkout's ``pretrain_gpt.py``
is the other way in: it calls ``megatron_wlb.megatron.apply()``.

Above every other sub-package (it may import them all); nothing here imports it. Importing the package runs nothing.
"""
