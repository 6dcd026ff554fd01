"""The value types and the worker registry: a request's ``Route``, the backends and their pools,
their health checks and circuit breaker. Every layer above may import it (docs/proxy/code.md)."""
