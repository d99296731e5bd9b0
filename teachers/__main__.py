"""Teacher registry CLI: ``python -m teachers --help`` (see :mod:`teachers.cli`)."""

import sys

from teachers.cli import main

sys.exit(main())
