"""Tests of one module or a few, in process: the real model where they need one, no kvgate server."""
