"""Code that runs inside a vLLM engine, not in the daemon: the step heartbeat scheduler.

The daemon puts this folder on the engine's ``PYTHONPATH`` (engine/launch.py), so its modules
import as top-level names there; they use the standard library and vLLM only.
"""
