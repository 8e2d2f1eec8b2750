"""Upstream change sources behind one interface (``app.sources.base``)."""
