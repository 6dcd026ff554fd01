"""Cache-aware routing: what each replica's prefix cache holds, and where a request goes for it.

- ``events``: vLLM's KV-event messages (ZMQ frames, msgpack) decoded into plain records;
- ``keys``: the proxy's own key of each block chain, from token ids and each block's extra keys
  (no hash-seed agreement); ``extra``: a request's extra keys (``cache_salt``, a LoRA adapter);
- ``index``: each event stream's blocks, with sequence tracking (gaps, restarts), its vLLM hashes
  in a ``table``, its keys in ``holders``: one index per role, block key -> the replicas holding
  it, bounded in memory; ``_chain.c`` and ``_block_table.c``: the C part behind keys, holders
  and table (Python fallbacks where it was not built);
- ``pending``: what the proxy sent where that events have not announced yet; ``approx``: the
  same lookup from its own routing history, for replicas without events;
- ``scorer``: the cost of each replica (estimated time in prompt tokens) and the choice;
- ``publishers``, ``subscriber``, ``loop_share``: the I/O (``GET /kv_event_sources``, ZMQ
  subscriptions, their share of the event loop); ``follow``: all of it kept in step with the
  pools; ``metrics``: its Prometheus series;
- ``router``: the glue a mode calls to get a route (decode, prefill, cached tokens, reason).

Everything but the I/O, ``follow`` and ``router`` is pure and tested without a network.
"""
