"""The data path, from Megatron's args to this rank's micro-batches: ``iterators`` (the one builder),
``packed`` (``WlbDataIterator``: packer plan -> this rank's host batch), ``prefetch`` (the next micro-batch built
while the current one trains), ``device`` (this rank's device), and the intakes: Megatron's GPT datasets
(``gpt_datasets``, ``gpt_samples``: the balanced concat-and-cut; ``sample_orders``: their order outside a job;
``sample_agreement``: what fills each sample, as the agreement compares it) and SFT jsonl (``sft``).

Above ``args``, below ``state``, ``hooks`` and ``entry``. Importing the package runs nothing.
"""
