"""llm-supervisor: keeps local vLLM inference engines alive."""

__version__ = "0.1.0"
__all__ = ["__version__"]
