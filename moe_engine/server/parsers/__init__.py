"""Parsers of model output text for the OpenAI-style APIs: tool calls and reasoning.

`base.py` holds the interfaces and the streaming machinery every parser shares; each family's
format is one module (`tools_*.py`, `reasoning_*.py`); `registry.py` names them (the names of
vLLM's `--tool-call-parser` / `--reasoning-parser` where vLLM has the format) and picks one from
a checkpoint's architecture and chat template.
"""
