"""`python3 -m pcp_pd_kit.preflight`: exit status = number of FAIL lines, capped at 100."""

from __future__ import annotations

import sys

if sys.version_info < (3, 8):  # noqa: UP036 - GPU hosts run this with their system python3
    sys.stderr.write("preflight: needs Python 3.8 or newer as python3\n")
    sys.exit(100)

from pcp_pd_kit.preflight.cli import main

sys.exit(main())
