"""The gateway: OpenAI-compatible routes over a backend; keys, limits, metrics; the command line."""
