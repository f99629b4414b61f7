"""``python -m densepass``: the command line."""

import sys

from densepass.cli import main

sys.exit(main())
