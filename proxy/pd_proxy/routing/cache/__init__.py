"""Cache-aware routing: what each replica's prefix cache holds, and where a request goes for it.

- ``events``: vLLM's KV-event messages (ZMQ frames, msgpack) decoded into plain records;
- ``keys``: the proxy's own key of each block chain, from token ids and each block's extra keys
  (no hash-seed agreement); ``extra``: a request's extra keys (``cache_salt``, a LoRA adapter);
- ``index``: each event stream's blocks, with sequence tracking (gaps, restarts), kept in
  ``holders``: one index per role, block key -> the replicas holding it, bounded in memory;
- ``approx``: the same lookup from the proxy's own routing history, for replicas without events;
- ``scorer``: the cost of each replica (estimated time in prompt tokens) and the choice;
  ``load``: the tokens each leg of a planned request computes, for the replicas' load;
- ``tokens``: the local tokenizer and chat template, checked against a decode's ``/tokenize``;
- ``subscriber`` and ``sources``: the I/O (ZMQ subscriptions, ``GET /kv_event_sources``);
- ``router``: the glue a mode calls to get a plan (decode, prefill, cached tokens, reason).

Everything but ``subscriber``, ``sources`` and ``router`` is pure and tested without a network.
"""
