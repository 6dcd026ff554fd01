"""Admission: a request starts only when its route has room, else it waits in a bounded, fair
queue, else it is refused at once with ``Retry-After``.

- ``fair_queue``: the queued requests, by priority band, then start-time fair queuing over
  flows by token cost (pure);
- ``room``: what each replica has in flight (requests, prompt tokens, KV waiting for a decode's
  pull) against the limits, and the replica with most room (pure);
- ``rate``: the served token rate, for a queued request's predicted wait (pure);
- ``gate``: the stage the pipeline awaits: admit now, queue, or refuse; and the lease a request
  holds until each part of its room is given back;
- ``metrics``: queue depth and wait per flow, outcomes by reason, room per replica.
"""
