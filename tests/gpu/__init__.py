"""Tests that need a CUDA device (skipped without one)."""
