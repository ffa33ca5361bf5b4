"""kvrelay inside other engines. `vllm/`: kvrelay's KV connectors as vLLM KV connectors.

Importing this package imports no other engine; each integration imports its engine lazily.
"""
