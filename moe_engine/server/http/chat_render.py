"""Chat messages (with tool calls, tool results and reasoning) through the chat template.

The conversation is handed to transformers' `apply_chat_template(conversation, tools=...,
add_generation_prompt=..., continue_final_message=..., **chat_template_kwargs)` and rendered to
text, then tokenized without added special tokens (as vLLM and `LLM.chat` do). Messages are the
dicts the families' own templates read (Qwen3, DeepSeek-V3/V3.1, Kimi-K2, GLM-4.5, gpt-oss):
`{"role", "content"}`, an assistant's `tool_calls` as `[{"id", "type": "function", "function":
{"name", "arguments"}}]` with `arguments` parsed into an object (vLLM's
`_postprocess_messages` does the same, since templates iterate `arguments.items()` or apply
`tojson`), its `reasoning_content` (and vLLM's newer `reasoning`), a tool message's
`tool_call_id` and `name`. The assistant's `content` stays None where the request had null (the
DeepSeek templates test `content is none`).

`add_generation_prompt` and `continue_final_message` follow vLLM: both true is refused, and
vLLM's `add_generation_prompt` default is true, so continuing needs `add_generation_prompt:
false`.
"""

from __future__ import annotations

import json
from typing import Any

from moe_engine.server.http.errors import OpenAIError
from moe_engine.server.http.protocol import ChatMessage, ChatTool

#: Keys of `chat_template_kwargs` that are arguments of the request itself (or would change
#: what `apply_chat_template` returns); they are refused, naming the request field to use.
_RESERVED_KWARGS = {
    "conversation": "messages", "messages": "messages", "tools": "tools",
    "add_generation_prompt": "add_generation_prompt",
    "continue_final_message": "continue_final_message", "chat_template": "--chat-template",
    "tokenize": None, "return_dict": None, "return_tensors": None, "documents": None,
}


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the template's dicts.

    Raises:
        OpenAIError: 400 naming `messages[i].tool_calls[j].function.arguments` when the
            arguments text is not a JSON object.
    """
    out = []
    for i, m in enumerate(messages):
        empty = m.content is None and m.refusal is None
        entry: dict[str, Any] = {"role": m.role, "content": None if empty else m.text()}
        if m.name is not None:
            entry["name"] = m.name
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None:
            entry["reasoning_content"] = entry["reasoning"] = reasoning
        if m.tool_calls is not None:
            entry["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name,
                              "arguments": _arguments(c.function.arguments,
                                                      f"messages[{i}].tool_calls[{j}]")}}
                for j, c in enumerate(m.tool_calls)
            ]
        out.append(entry)
    return out


def _arguments(arguments: str | dict[str, Any], where: str) -> dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    field = f"{where}.function.arguments"
    try:
        value = json.loads(arguments)
    except ValueError as exc:
        raise OpenAIError(400, f"{field}: not valid JSON ({exc}): {arguments[:80]!r}", field,
                          "invalid_value") from None
    if not isinstance(value, dict):
        raise OpenAIError(400, f"{field}: must be the JSON text of an object, got "
                          f"{arguments[:80]!r}", field, "invalid_value")
    return value


def tool_dicts(tools: list[ChatTool] | None) -> list[dict[str, Any]] | None:
    """`tools` as the template's `tools` variable (OpenAI's shape, unset fields left out)."""
    if not tools:
        return None
    return [t.model_dump(exclude_none=True) for t in tools]


def template_kwargs(
    add_generation_prompt: bool, continue_final_message: bool,
    chat_template_kwargs: dict[str, Any] | None, messages: list[ChatMessage],
) -> dict[str, Any]:
    """The keyword arguments of `apply_chat_template` besides the conversation and tools.

    Raises:
        OpenAIError: 400 for both `continue_final_message` and `add_generation_prompt`,
            continuing a last message that is not the assistant's, or a reserved key in
            `chat_template_kwargs` (naming it and the field to use instead).
    """
    if continue_final_message and add_generation_prompt:
        raise OpenAIError(
            400, "continue_final_message: cannot be true with add_generation_prompt true (the "
            "default); send add_generation_prompt: false to continue the last message",
            "continue_final_message", "invalid_value")
    if continue_final_message and messages[-1].role != "assistant":
        raise OpenAIError(
            400, f"continue_final_message: the last message must be the assistant's, got a "
            f"{messages[-1].role} message", "continue_final_message", "invalid_value")
    kwargs = dict(chat_template_kwargs or {})
    for key in kwargs:
        if key in _RESERVED_KWARGS:
            instead = _RESERVED_KWARGS[key]
            hint = f"; use {instead} instead" if instead else ""
            raise OpenAIError(
                400, f"chat_template_kwargs.{key}: not a template variable one may set{hint}",
                f"chat_template_kwargs.{key}", "invalid_value")
    kwargs.update(add_generation_prompt=add_generation_prompt,
                  continue_final_message=continue_final_message)
    return kwargs


def render_text(
    tokenizer: Any, chat_template: str | None, messages: list[ChatMessage],
    tools: list[ChatTool] | None = None, *, add_generation_prompt: bool = True,
    continue_final_message: bool = False, chat_template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text the chat template makes of the conversation.

    Args:
        tokenizer: the served tokenizer (None: refused).
        chat_template: `--chat-template`'s text, or None for the tokenizer's own.

    Raises:
        OpenAIError: 400 ("messages") without a tokenizer or a chat template, when the template
            refuses the conversation, or for a bad field (`template_kwargs`, `conversation`).
    """
    if tokenizer is None or not (chat_template or getattr(tokenizer, "chat_template", None)):
        what = "no tokenizer" if tokenizer is None else "a tokenizer without a chat template"
        raise OpenAIError(
            400, f"messages: the served model has {what}; use /v1/completions with a prompt "
            "(or serve with --chat-template)", "messages", "unsupported_value",
        )
    kwargs = template_kwargs(add_generation_prompt, continue_final_message,
                             chat_template_kwargs, messages)
    try:
        return tokenizer.apply_chat_template(
            conversation(messages), tools=tool_dicts(tools), tokenize=False,
            chat_template=chat_template, **kwargs,
        )
    except OpenAIError:
        raise
    except Exception as exc:  # noqa: BLE001 - jinja's errors (TemplateError, raise_exception)
        raise OpenAIError(
            400, f"messages: the chat template refused them: {exc}", "messages", "invalid_value"
        ) from exc


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file's path (read) or the template itself (vLLM's rule: a value
    with none of the characters `{}` and a newline is a path).

    Raises:
        ValueError: the value looks like a path and cannot be read (naming the flag).
    """
    if value is None:
        return None
    if any(c in value for c in "{}\n"):
        return value
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise ValueError(f"--chat-template: cannot read {value!r} ({exc.strerror or exc}); give "
                         "a template file's path or the Jinja template itself") from None
