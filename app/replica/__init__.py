"""The SQLite replica: its metadata tables, the replicator that applies a change
stream to it, and the initial sync that creates it."""
