"""A fault harness for ``changestreamer serve`` over a real Postgres upstream.

A seeded writer commits random transactions upstream while ``serve`` runs; several
subscribers follow the stream over raw protocol-v6 websockets, resuming after every
drop; faults are injected in a seeded loop; and an oracle compares, row by row,
every subscriber's applied state and the service's replica with Postgres, and
counts lost and duplicated transactions from the writer's ``seq`` table.

Modules, one idea each:

* :mod:`~faults.upstream` — the scratch database, its schema and the seeded writer;
* :mod:`~faults.subscriber` — a resuming v6 subscriber that records what it got,
  and the misbehaving ones (stalled, wrong ack, flood);
* :mod:`~faults.service` — one ``serve`` process: start, kill, readiness, its
  process tree, RSS, ``/ready``, ``/metrics`` and its log;
* :mod:`~faults.oracle` — the row-by-row comparisons and the lost/duplicate counts;
* :mod:`~faults.scenarios` — the faults, each a seeded loop, and their figures;
* :mod:`~faults.report` — the markdown table;
* ``python -m faults`` — the full loop from the command line.

Loopback only; databases are named ``flt_*`` and the app ID is ``flt``, so slots
(``flt_0_*``) and publications are this harness's own.
"""
