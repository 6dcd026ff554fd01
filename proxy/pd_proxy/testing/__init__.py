"""Test helpers shipped with the proxy (fake vLLM backends)."""
