"""Moved: the ``.idx`` reader is ``megatron_wlb.data.indexed`` (the data layer); this name stays for
importers written against it."""

from megatron_wlb.data.indexed import IDX_MAGIC, parse_idx, read_idx_lengths  # noqa: F401
