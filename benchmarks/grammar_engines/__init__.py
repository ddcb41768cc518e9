"""Constrained-decoding engines side by side: llguidance, xgrammar, outlines-core (see __main__.py).

Standalone: it imports no kvgate module, and its files import each other relatively. Run it from the benchmarks
folder, in a virtualenv that has torch, transformers, jsonschema and any of the three engines:

    cd benchmarks && python -m grammar_engines --runs 200 --json /tmp/grammar_engines.json
"""
