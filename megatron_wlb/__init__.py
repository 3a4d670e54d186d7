"""megatron-wlb: workload-balanced 4D parallelism (WLB-LLM, OSDI'25) for Megatron-LM.

Layout of the package, one folder per level of the system:

- ``costmodel``: W(d) = W_a(d) + W_l(d), analytic from the model shape or calibrated on a GPU.
- ``packing``:   PP level, documents into micro-batches (original, fixed-greedy, fixed-solver, wlb).
- ``cp``:        CP level, shard layouts per micro-batch and all-gather context-parallel attention.
- ``schedule``:  the pipeline schedule engine (1F1B, interleaved), below ``packing`` and ``sim``.
- ``sim``:       an event-level simulator of one 4D-parallel iteration and the paper's experiments.
- ``megatron``:  the thin adapter that hooks all of the above into Megatron-LM.
- ``cli``:       the ``wlb`` command.

Everything but ``cp.attention`` and ``megatron`` imports without torch.
"""

__version__ = "0.1.0"
