"""``python -m kvserve.clients``: see :mod:`clients.cli`."""

import sys

from kvserve.clients.cli import main

sys.exit(main())
