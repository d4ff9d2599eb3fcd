"""``mpflow.service.results`` is :mod:`mpflow.client.results` under its former name; new code imports
:mod:`mpflow.client.results`."""

import sys

from mpflow.client import results

sys.modules[__name__] = results
