"""``mpflow.service.client`` is :mod:`mpflow.client.http` under its former name (the client moved out of the server
package so that it installs without it); new code imports :mod:`mpflow.client`."""

import sys

from mpflow.client import http

sys.modules[__name__] = http
