"""SAECache-Gym: the prefix (KV) cache of an LLM server as a Gymnasium environment."""

from sae_env.env import ENV_ID as ENV_ID  # registers the Gymnasium env (sae_env/PrefixCache-v0)
from sae_env.trace import AppType, LoadReport, TokenType, Trace, TraceFormatError

__version__ = "0.1.0"
__all__ = ["AppType", "LoadReport", "TokenType", "Trace", "TraceFormatError", "__version__"]
