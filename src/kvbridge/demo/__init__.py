"""Demo and integration-test tooling: a tiny random-weight model built locally
(:mod:`kvbridge.demo.model`) and a supervisor for real vLLM server processes
(:mod:`kvbridge.demo.servers`). Importing this package imports no engine.
"""
