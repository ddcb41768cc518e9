"""The real frameworks and SDKs as clients of a real kvgate server."""
