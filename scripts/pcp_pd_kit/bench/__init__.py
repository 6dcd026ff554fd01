"""`pcp-pd-kit bench KIND`: the kit's benchmarks, one module per kind (bench.kinds lists them),
one results layout (bench.results). Pure parts (plans, tables, reports) live apart from the I/O
(client, the kinds' run functions), so they are tested without starting anything."""
