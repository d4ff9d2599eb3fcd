"""``python -m mpflow``: the ``mpflow`` command line (:mod:`mpflow.cli`)."""

from mpflow.cli import main

raise SystemExit(main())
