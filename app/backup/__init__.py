"""Backups of the replica: litestream, the backed-up watermark stream, restores.

* ``config`` — litestream's configuration from Zero's ``ZERO_LITESTREAM_*`` settings;
* ``process`` — litestream as a supervised child of ``serve``;
* ``restore`` — a replica restored from its backup, atomically;
* ``watermarks`` — the pollers: what the backup (or, without one, the replica) holds;
* ``vfs_worker`` — the child that reads the backup through the litestream VFS;
* ``monitor`` — watermarks → the streamer's purge and reservations, readiness.
"""
