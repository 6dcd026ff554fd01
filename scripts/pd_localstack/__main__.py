"""Allow `python -m pd_localstack`."""

import sys

from pd_localstack.cli import main

sys.exit(main())
