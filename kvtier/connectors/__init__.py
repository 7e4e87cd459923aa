"""Connectors: the hooks an inference engine calls before prefill and after a request."""
