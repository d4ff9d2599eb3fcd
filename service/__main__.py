"""``python -m service``: serve (see :mod:`service.cli`)."""

import sys

from service.cli import main

sys.exit(main())
