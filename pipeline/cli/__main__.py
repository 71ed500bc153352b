"""``python -m pipeline.cli``: the ``rlstream`` command line."""

import sys

from pipeline.cli.main import main

sys.exit(main())
