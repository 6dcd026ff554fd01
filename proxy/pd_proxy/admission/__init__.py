"""Admission: a request starts only when its route has room, else it waits in a bounded, fair
queue, else it is refused at once with ``Retry-After``.

- ``fair_queue``: who asks (``Flow``) and the queued requests, by priority band, then start-time
  fair queuing over flows by token cost (pure);
- ``room``: what each replica has in flight (requests, prompt tokens, KV waiting for a decode's
  pull) against the limits, and the replica with most room (pure);
- ``rate``: the served token rate, for a queued request's predicted wait (pure);
- ``gate``: the stage the pipeline awaits: admit now, queue, or refuse;
- ``lease``: what an admitted request holds until each part of its room is given back, and the
  wake-up that lets the queue in from the event loop, off the request's own walk;
- ``metrics``: queue depth and wait per flow, outcomes by reason, room per replica.
"""
