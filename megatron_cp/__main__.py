"""``python -m megatron_cp plan|compare ...``: the command line of ``megatron_cp.cli``."""

import sys

from megatron_cp.cli import main

sys.exit(main())
