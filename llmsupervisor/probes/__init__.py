"""Probes: read-only looks at an engine, each with its own deadline; failures are data."""
