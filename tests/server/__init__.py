"""Tests against a real kvgate server (uvicorn on loopback, or the app in process) over HTTP."""
