"""Event-level simulator of one 4D-parallel training iteration, and the paper's experiments.

- ``megatron_wlb.schedule`` (below packing and sim, re-exported here): 1F1B and interleaved 1F1B played out
  event by event over variable times.
- ``iteration``:   a packer's global batch + a CP layout + the cost model -> iteration time.
- ``dyncp``:       Megatron-LM's dynamic CP sizes per document, as a further baseline.
- the ``whole-document`` baseline packer is ``packing/whole_document.py`` (a ``--wlb-packer`` choice too).
- ``experiments``: the paper's experiments as pure functions returning tables.
- ``report``:      markdown and figures (matplotlib, Agg) of ``wlb reproduce`` / ``wlb analyze``.
"""

from megatron_wlb.schedule import Op, PipelineResult, op_order, simulate_pipeline, textbook_1f1b

__all__ = ["Op", "PipelineResult", "op_order", "simulate_pipeline", "textbook_1f1b"]
