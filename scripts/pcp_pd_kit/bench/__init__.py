"""`pcp-pd-kit bench`: vLLM's own serving benchmark, single instance vs P/D.

`vllm bench serve` (run through `python -m pcp_pd_kit.bench.vllm_serve`, see there) against a
plain vLLM instance and against the P/D pair through pd-proxy, same model and seeded random
dataset, at several concurrencies; a side-by-side table, the P/D overhead breakdown read from the
servers' histograms, a short-prompt table with P/D through a pd-proxy with
--local-prefill-max-tokens (issue 27, bench.local_prefill), and every JSON result plus a manifest
under results/serve-<UTC time>/ (bench.results: the layout every kind shares; bench.kinds: the
other kinds).

The pure parts (argument lists, tables, ratios, histogram deltas, the manifest) live apart from
the process I/O (runner) so they are unit-tested without starting anything.
"""
