"""Docker HEALTHCHECK: exit 0 when kvserve's GET /health answers 200 {"status": "ok"}, else 1.

Standard library only, so it starts in tens of milliseconds and needs no curl in the slim image.
Reads the port from KVSERVE_PORT (default 8000) and always asks 127.0.0.1: the check runs inside the
container, where the server listens on 0.0.0.0.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request

TIMEOUT_S = 4.0  # under the Dockerfile's --timeout=5s, so a hung server is reported as unhealthy, not killed


def main() -> int:
    """Returns the exit status: 0 healthy, 1 unhealthy (the reason goes to stderr, which Docker keeps)."""
    url = f"http://127.0.0.1:{os.environ.get('KVSERVE_PORT', '8000')}/health"
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as error:  # 503: the engine loop died
        print(f"{url}: HTTP {error.code}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as error:  # refused, timed out, or not JSON
        print(f"{url}: {error}", file=sys.stderr)
        return 1
    if not isinstance(body, dict) or body.get("status") != "ok":
        print(f"{url}: {body}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
