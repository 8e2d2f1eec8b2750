"""Composition: what ``serve`` builds for each upstream (the service, its replica, the
replica follower). The packages below this one know nothing of each other's wiring."""
