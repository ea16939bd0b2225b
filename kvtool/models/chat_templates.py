"""Chat templates for GGUF files that carry none (tokenizer.chat_template absent), by model_type.

Gemma's turn format: `<start_of_turn>ROLE\n…<end_of_turn>\n`, roles user and model; a system message
opens the first user turn, a tool result is a user turn. The prompt starts with `<bos>`.
"""

from __future__ import annotations

GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set system = messages[0]['content'] ~ '\\n\\n' if messages and messages[0]['role'] == 'system' else '' -%}"
    "{%- for message in messages if message['role'] != 'system' -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else 'user' -%}"
    "{%- set text = message['content'] if message['content'] is string else "
    "(message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('')) -%}"
    "{{ '<start_of_turn>' ~ role ~ '\\n' ~ (system if loop.first else '') ~ (text or '') | trim ~ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)

TEMPLATES = {"gemma3_text": GEMMA_TEMPLATE, "gemma3": GEMMA_TEMPLATE}


def default_template(model_type: str | None) -> str | None:
    """The template to give a tokenizer of `model_type` that came without one, or None."""
    return TEMPLATES.get(model_type or "")
