"""``python -m gsm8k_eval [flags]``: see ``--help`` (gsm8k_eval.cli.USAGE)."""

from gsm8k_eval.entry import main

raise SystemExit(main())
