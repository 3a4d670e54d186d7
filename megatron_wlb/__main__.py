"""``python -m megatron_wlb``: the ``wlb`` command."""

import sys

from megatron_wlb.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
