"""A tiny model that takes tools: the seed-0 tiny llama with a Hermes-style chat template (the
markers mlx-lm infers its json_tools format from), and a schema whose values are small, so a
random model's call ends within a few tokens."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# A Hermes-style template for the tiny model (the markers mlx-lm infers json_tools from).
TOOL_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\nYou may call these functions:\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    "{{- 'Reply with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant\\n' + message.content }}"
    "{%- for tool_call in message.tool_calls %}{%- set tool_call = tool_call.function %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response>"
    "<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

# Small values only: a call under the grammar ends within a few tokens.
FORECAST = {"type": "object", "properties": {
    "unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "rain": {"type": "boolean"}}, "required": ["unit", "days", "rain"],
    "additionalProperties": False}


def tools_model(tiny_llama: Path, dest: Path) -> Path:
    """A copy of `tiny_llama` at `dest` whose chat template renders tools."""
    shutil.copytree(tiny_llama, dest)
    cfg = json.loads((dest / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TOOL_TEMPLATE
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dest


def conforms(value: object, schema: dict) -> None:
    """`value` is valid against `schema` (jsonschema raises where it is not)."""
    import jsonschema

    jsonschema.validate(value, schema)


def clients(node):
    """The real openai and anthropic clients on a test node (no retries, long timeouts)."""
    import anthropic
    import openai
    return (openai.OpenAI(base_url=node.base + "/v1", api_key="none", max_retries=0,
                          timeout=300),
            anthropic.Anthropic(base_url=node.base, api_key="none", max_retries=0,
                                timeout=300))
