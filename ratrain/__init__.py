"""ratrain: a resource-aware training runtime for dense LLMs."""

__version__ = "0.1.0"
