"""pcp-pd-kit's tests: one package, so helpers are imported as `tests.support...` (no sys.path)."""
