"""kvgate: an OpenAI-compatible gateway in front of its own runtime (see DESIGN.md)."""
