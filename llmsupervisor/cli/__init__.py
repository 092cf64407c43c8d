"""The `llm-supervisor` command: entry point cli/main.py."""
