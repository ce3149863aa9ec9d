"""``python -m testbed.cli``: the ``testbed`` command (torchrun starts it this way)."""

import sys

from testbed.cli.main import main

sys.exit(main())
