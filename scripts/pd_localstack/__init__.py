"""The kit's embedded CPU stack: prefill + decode vLLM over NIXL, the kit's proxy and Prometheus.

`python -m pd_localstack up` keeps the stack until Ctrl-C; `python -m pd_localstack demo` runs a
small GSM8K slice through it and reports what the live system says. The pure pieces (env layering,
command lines, Prometheus config, metric checks) live apart from the process I/O so they are
unit-tested without starting anything.
"""
