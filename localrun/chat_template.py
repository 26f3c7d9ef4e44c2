"""Chat prompts from the GGUF's `tokenizer.chat_template`, rendered with jinja2 the way
Hugging Face's tokenizers render them (sandboxed, trim_blocks, lstrip_blocks)."""
from __future__ import annotations

from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from localrun.errors import UserError

# used when a GGUF carries no template
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
          " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

ROLES = ("system", "user", "assistant", "tool")


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def validate_messages(messages) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise UserError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise UserError(f"message {i} must be an object with 'role' and 'content'")
        if m["role"] not in ROLES:
            raise UserError(f"message {i} has role '{m['role']}'; expected one of {', '.join(ROLES)}")
        content = m.get("content")
        if content is None:
            content = ""
        if isinstance(content, list):   # OpenAI content parts: keep the text parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            raise UserError(f"message {i} content must be a string")
        out.append({**m, "content": content})
    return out


def render_chat(template: str | None, messages, *, bos_token: str = "", eos_token: str = "",
                add_generation_prompt: bool = True) -> str:
    """The prompt text for `messages` (a list of {role, content} dicts)."""
    messages = validate_messages(messages)
    try:
        return _compile(template or CHATML).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=bos_token, eos_token=eos_token)
    except jinja2.exceptions.TemplateError as e:
        raise UserError(f"the model's chat template failed to render these messages: {e}") from None
