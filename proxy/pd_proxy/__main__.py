"""Allow ``python -m pd_proxy``."""

from pd_proxy.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
