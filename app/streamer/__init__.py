"""The change-streamer core: forward, store, ack; catch-up; flow control; purge."""
