"""The tool-call parsers by name (`--tool-call-parser NAME`, vLLM's names).

`TOOL_PARSERS` maps each name to its class; `registry.py` picks one per checkpoint.
"""

from __future__ import annotations

from moe_engine.server.parsers.base import ToolParser
from moe_engine.server.parsers.tools_deepseek import DeepSeekV3ToolParser, DeepSeekV31ToolParser
from moe_engine.server.parsers.tools_glm45 import Glm45ToolParser
from moe_engine.server.parsers.tools_hermes import HermesToolParser
from moe_engine.server.parsers.tools_kimi_k2 import KimiK2ToolParser
from moe_engine.server.parsers.tools_qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls
    for cls in (
        HermesToolParser,
        Qwen3CoderToolParser,
        DeepSeekV3ToolParser,
        DeepSeekV31ToolParser,
        KimiK2ToolParser,
        Glm45ToolParser,
    )
}
