"""``python -m kvserve.kernels --build``."""

import sys

from kvserve.kernels import main

sys.exit(main())
