"""SAECache-Gym: the prefix (KV) cache of an LLM server as a Gymnasium environment."""

from sae_env.trace import AppType, LoadReport, TokenType, Trace, TraceFormatError

__version__ = "0.1.0"
__all__ = ["AppType", "LoadReport", "TokenType", "Trace", "TraceFormatError", "__version__"]
