"""The OpenAI-compatible API: /v1/completions, /v1/chat/completions, /v1/models (being built)."""

from __future__ import annotations


def add_routes(app, service) -> None:
    """Adds the /v1 routes to the router's aiohttp app."""
