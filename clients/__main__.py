"""``python -m clients``: see :mod:`clients.cli`."""

import sys

from clients.cli import main

sys.exit(main())
