"""``python -m chronicals ...`` is ``chronicals ...``."""

import sys

from .cli import main

sys.exit(main())
