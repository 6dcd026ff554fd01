"""The modes that run a request's legs, each with its pure protocol rewrite beside it.

- ``normal``: prefill for the KV, decode for the whole answer (the default);
- ``first_token`` (+ ``first_token_rewrite``): token 1 from the prefill leg, the rest from decode
  (``--first-token-from-prefill``); requests it cannot serve exactly take the normal mode;
- ``decode_alone``: decode prefills the prompt itself (shapes P/D cannot serve, short prompts);
- ``fanout`` (+ ``fanout_rewrite``): one P/D request per choice, answers merged.

pd_proxy.pipeline picks the mode for each request from its shape and its ``Route``.
"""
