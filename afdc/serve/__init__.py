"""Serving under vLLM: the attention role runs inside vLLM's V1 engine (``afdc[serve]``).

vLLM's scheduler, KV-block manager, sampler and OpenAI server are used as they are; afdc
plugs in through vLLM's out-of-tree extension points (a platform plugin and a worker).
"""
