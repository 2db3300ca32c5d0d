"""``python -m kvserve.native --build``."""

import sys

from kvserve.native import main

sys.exit(main())
