"""The parser registry: names, refusals, where the output starts, the default pick.

Template excerpts below are this project's own short text in each family's documented format
(sources: the chat templates copied in llama.cpp's `models/templates/`, cited in
`moe_engine/server/parsers/registry.py` and the parser modules).
"""

from __future__ import annotations

import pytest

from moe_engine.server.parsers import registry
from moe_engine.server.parsers.harmony import HarmonyToolParser

PROMPTS = [  # (parser name, rendered prompt tail, output starts inside reasoning)
    ("deepseek_r1", "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜><think>\n", True),
    ("deepseek_r1", "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜>", True),  # old template
    ("deepseek_v31", "<｜User｜>hi<｜Assistant｜><think>", True),
    ("deepseek_v31", "<｜User｜>hi<｜Assistant｜></think>", False),
    ("deepseek_v31", "<｜User｜>a<｜Assistant｜></think>b<｜end▁of▁sentence｜><｜User｜>c"
     "<｜Assistant｜><think>", True),
    ("qwen3", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", False),
    ("qwen3", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
     False),
    ("qwen3", "<|im_start|>assistant\n<think>\nold\n</think>\n\nx<|im_end|>\n<|im_start|>user\n"
     "q<|im_end|>\n<|im_start|>assistant\n<think>\n", True),
    ("qwen3", "<|im_start|>assistant\n<think>\nA continued thought", True),
    ("qwen3", "Explain the <think> tag", False),  # no assistant turn: only the end counts
    ("glm45", "[gMASK]<sop><|user|>\nhi<|assistant|>", False),
    ("glm45", "[gMASK]<sop><|user|>\nhi/nothink<|assistant|>\n<think></think>", False),
    ("kimi_k2", "<|im_assistant|>assistant<|im_middle|><think></think>Hi<|im_end|><|im_user|>"
     "user<|im_middle|>q<|im_end|><|im_assistant|>assistant<|im_middle|>", True),
    ("openai_gptoss", "<|start|>user<|message|>hi<|end|><|start|>assistant", False),
    ("openai_gptoss", "<|start|>assistant<|channel|>analysis<|message|>Let me", True),
    ("openai_gptoss", "<|start|>assistant<|channel|>final<|message|>Sure", False),
]


@pytest.mark.parametrize("name,prompt,expected", PROMPTS)
def test_starts_in_reasoning_from_the_prompt_tail(name, prompt, expected):
    assert registry.starts_in_reasoning(prompt, name) is expected
    assert registry.reasoning_parser(name, prompt).starts_in_reasoning is expected


QWEN3_TEMPLATE = """{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}...
For each function call, return a json object within <tool_call></tool_call> XML tags:
<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>
{%- endif %}{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content }}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"""
QWEN3_CODER_TEMPLATE = """{{- '<|im_start|>system\\n' }}<tool_call>
<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>
</function>\\n</tool_call>{{- '<|im_start|>assistant\\n' }}"""
GLM45_TEMPLATE = """[gMASK]<sop>{%- if tools -%}<|system|>\\n# Tools
<tool_call>{function-name}\\n<arg_key>{arg-key-1}</arg_key>\\n<arg_value>{v}</arg_value>
</tool_call>{%- endif -%}<|assistant|>{{ '\\n<think></think>' }}"""
DEEPSEEK_V3_TEMPLATE = """{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' +
tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' +
tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"""
DEEPSEEK_R1_TEMPLATE = DEEPSEEK_V3_TEMPLATE + """{% if '</think>' in content %}{% endif %}
{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\\n'}}{% endif %}"""
DEEPSEEK_V31_TEMPLATE = """{%- if not thinking is defined -%}{%- set thinking = false -%}
{%- endif -%}{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] +
'<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}
{%- if add_generation_prompt -%}{{'<｜Assistant｜>'}}{%- if not thinking -%}{{'</think>'}}
{%- else -%}{{'<think>'}}{%- endif -%}{%- endif %}"""
KIMI_K2_TEMPLATE = """<|im_assistant|>{{role_name}}<|im_middle|><|tool_calls_section_begin|>
<|tool_call_begin|>{{ formatted_id }}<|tool_call_argument_begin|>{{ args }}<|tool_call_end|>
<|tool_calls_section_end|>"""
KIMI_K2_THINKING_TEMPLATE = KIMI_K2_TEMPLATE + "<think>{{rc}}</think>{{render_content(m)}}"
GPT_OSS_TEMPLATE = """{{- "<|start|>assistant<|channel|>commentary to=functions." + name +
" <|constrain|>json<|message|>" + args + "<|call|>" }}{%- if add_generation_prompt -%}
<|start|>assistant{%- endif -%}"""

TEMPLATES = [  # (architecture, template, (tool parser, reasoning parser))
    ("Qwen3MoeForCausalLM", QWEN3_TEMPLATE, ("hermes", "qwen3")),
    ("Qwen3MoeForCausalLM", QWEN3_CODER_TEMPLATE, ("qwen3_coder", "qwen3")),
    ("Glm4MoeForCausalLM", GLM45_TEMPLATE, ("glm45", "glm45")),
    ("DeepseekV3ForCausalLM", DEEPSEEK_V3_TEMPLATE, ("deepseek_v3", None)),
    ("DeepseekV3ForCausalLM", DEEPSEEK_R1_TEMPLATE, ("deepseek_v3", "deepseek_r1")),
    ("DeepseekV3ForCausalLM", DEEPSEEK_V31_TEMPLATE, ("deepseek_v31", "deepseek_v31")),
    ("DeepseekV3ForCausalLM", KIMI_K2_TEMPLATE, ("kimi_k2", None)),
    ("DeepseekV3ForCausalLM", KIMI_K2_THINKING_TEMPLATE, ("kimi_k2", "kimi_k2")),
    ("GptOssForCausalLM", GPT_OSS_TEMPLATE, ("openai", "openai_gptoss")),
    ("SomeNewForCausalLM", GPT_OSS_TEMPLATE, ("openai", "openai_gptoss")),  # template wins
    ("Glm4MoeForCausalLM", None, ("glm45", "glm45")),  # no template: the architecture
    ("GptOssForCausalLM", "{{ messages }}", ("openai", "openai_gptoss")),
    ("MixtralForCausalLM", "{{ messages }}", (None, None)),
]


@pytest.mark.parametrize("architecture,template,expected", TEMPLATES)
def test_default_parsers_from_the_checkpoint(architecture, template, expected):
    assert registry.default_parsers(architecture, template) == expected


def test_every_default_names_a_registered_reasoning_parser():
    for _, reasoning in registry.ARCHITECTURE_DEFAULTS.values():
        assert reasoning is None or reasoning in registry.REASONING_PARSERS
    assert set(registry.REASONING_PARSERS) == {
        "deepseek_r1", "deepseek_v31", "qwen3", "glm45", "kimi_k2", "openai_gptoss"}
    assert isinstance(registry.tool_parser("openai"), HarmonyToolParser)


def test_unknown_names_are_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match=r"--tool-call-parser: unknown name 'x'; choose from "
                                         r".*hermes.*openai"):
        registry.tool_parser("x", [])
    with pytest.raises(ValueError, match=r"--reasoning-parser: unknown name 'r2'; choose from "
                                         r"deepseek_r1, deepseek_v31, glm45, kimi_k2, "
                                         r"openai_gptoss, qwen3$"):
        registry.reasoning_parser("r2", "")
    with pytest.raises(ValueError, match="--reasoning-parser"):
        registry.starts_in_reasoning("", "nope")


def test_special_tokens_needed_only_by_harmony():
    assert registry.needs_special_tokens("openai_gptoss", None)
    assert registry.needs_special_tokens(None, "openai")
    assert not registry.needs_special_tokens("qwen3", "hermes")
    assert not registry.needs_special_tokens(None, None)
    assert not registry.needs_special_tokens("qwen3", None, {"<|im_end|>", "<|endoftext|>"})
    assert registry.needs_special_tokens("glm45", None, {"<think>", "</think>"})
    assert registry.needs_special_tokens("kimi_k2", None, {"<|tool_calls_section_begin|>"})
