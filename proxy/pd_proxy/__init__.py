"""pd-proxy: a small, fast, observable front door for vLLM prefill/decode disaggregation.

The proxy speaks the ``kv_transfer_params`` protocol that vLLM's NIXL connector expects: one
``max_tokens=1`` prefill leg, then the client's own request on a decode backend carrying the KV
handles the prefill returned.
"""

__version__ = "0.1.0"
