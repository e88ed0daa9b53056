"""``python -m batchgen``: the ``batchgen`` command without the console script."""

import sys

from batchgen.cli import main

sys.exit(main())
