"""`python -m pcp_pd_kit`: the same command line as the `pcp-pd-kit` console script."""

import sys

from pcp_pd_kit.cli import main

sys.exit(main())
