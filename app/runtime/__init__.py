"""Composition: what ``serve`` builds for each upstream (the service, its replica, the
backup replicator). The packages below this one know nothing of each other's wiring."""
