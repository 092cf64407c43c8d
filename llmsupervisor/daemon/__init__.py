"""The daemon: the fleet of engine runners, one reconcile loop, one request queue."""
