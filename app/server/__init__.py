"""The HTTP and websocket surface of the service (FastAPI)."""
