"""The kit's embedded CPU stack: prefill + decode vLLM over NIXL, the kit's proxy and Prometheus.

`pcp-pd-kit up` keeps the stack until Ctrl-C; `pcp-pd-kit demo` scores the kit's trained tiny
model on held-out GSM8K-format questions through it and on a single instance, and reports what the
live system says. The pure pieces (env layering, command lines, Prometheus config, metric
checks) live apart from the process I/O so they are unit-tested without starting anything.
"""
