"""Chat prompts from the GGUF's `tokenizer.chat_template`, rendered with jinja2 the way
Hugging Face's tokenizers render them (sandboxed, trim_blocks, lstrip_blocks), within limits
of time, size and recursion (localrun/template_sandbox.py): the template comes from a file.

`check_template` runs on first use: a template over the size bounds, that does not compile,
breaks a limit on sample conversations, fails on all of them or renders them all as nothing is
refused with one sentence, and the built-in ChatML template is used instead. `size_refusal`
is the part a header reader may ask (`localrun info`): the length alone, nothing compiled."""
from __future__ import annotations

from datetime import datetime
from functools import lru_cache

import jinja2

from localrun.errors import UserError
from localrun.template_sandbox import (BoundedEnvironment, Limits, TemplateLimitError, check_size, compile_template,
                                       one_line, render_bounded)

# used when a GGUF carries no template
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
          " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# Gemma's turn format, as Gemma 3's own template writes it (text only): the system prompt opens
# the first user turn, roles must alternate user/model, and the assistant is called "model".
GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
         "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}"
         "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
         "{% for message in loop_messages %}"
         "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
         "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
         "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
         "{% endif %}{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') "
         "+ message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
FAMILY_TEMPLATES = {"gemma": GEMMA, "chatml": CHATML}

ROLES = ("system", "user", "assistant", "tool")


def family_template(chat_format: str | None) -> str | None:
    """The built-in template of a family's turn format (Architecture.chat_format), None for none."""
    return FAMILY_TEMPLATES.get(chat_format) if chat_format else None


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


DEFAULT_LIMITS = Limits()
LOAD_LIMITS = Limits(seconds=0.5, max_chars=1 << 20)     # for the sample conversations at load
SAMPLE_CONVERSATIONS = (
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hello!"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
     {"role": "user", "content": "How are you?"}],
)


@lru_cache(maxsize=1)
def _environment() -> BoundedEnvironment:
    env = BoundedEnvironment()
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    """Compiled once, rendered under any Limits (the environment reads the render's)."""
    return compile_template(_environment(), source)


def size_refusal(source: str) -> str | None:
    """Why `source` is refused by its length alone, else None (check_template's sentence; it
    neither lexes nor compiles, so a header reader can ask)."""
    try:
        check_size(source)
    except TemplateLimitError as e:
        return f"the model's chat template is refused: {e}"
    return None


@lru_cache(maxsize=8)
def check_template(source: str) -> str | None:
    """None if `source` is a usable chat template, else one sentence saying why it is refused."""
    try:
        template = _compile(source)
    except TemplateLimitError as e:
        return f"the model's chat template is refused: {e}"
    except jinja2.exceptions.TemplateSyntaxError as e:
        return f"the model's chat template has a syntax error (line {e.lineno}: {one_line(e.message)})"
    failures, num_empty = [], 0
    for messages in SAMPLE_CONVERSATIONS:
        try:
            text = render_bounded(template, LOAD_LIMITS, messages=messages, add_generation_prompt=True,
                                  bos_token="<s>", eos_token="</s>")
        except TemplateLimitError as e:
            return f"the model's chat template is refused: {e}"
        except Exception as e:   # raise_exception() or a template bug: judged over all samples
            failures.append(f"{type(e).__name__}: {one_line(str(e))}")
        else:
            num_empty += not text.strip()
    if len(failures) == len(SAMPLE_CONVERSATIONS):
        return f"the model's chat template fails on every sample conversation ({failures[0]})"
    if num_empty + len(failures) == len(SAMPLE_CONVERSATIONS):
        return "the model's chat template renders every sample conversation as an empty prompt"
    return None


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
                add_generation_prompt: bool = True, limits: Limits = DEFAULT_LIMITS,
                tools: list[dict] | None = None) -> str:
    """The prompt text for `messages` (a list of {role, content} dicts); the built-in ChatML
    template when `template` is None or refused by check_template. Rendering is bounded by
    `limits`."""
    messages = validate_messages(messages)
    if template is not None and check_template(template):
        template = None
    try:
        compiled = _compile(template or CHATML)
        extra = {"tools": tools} if tools is not None else {}     # OpenAI tools, as HF templates take them
        return render_bounded(compiled, limits, messages=messages, add_generation_prompt=add_generation_prompt,
                              bos_token=bos_token, eos_token=eos_token, **extra)
    except TemplateLimitError as e:
        raise UserError(f"the model's chat template went past a limit on these messages: {e}") from None
    except jinja2.exceptions.TemplateError as e:
        raise UserError(f"the model's chat template failed to render these messages: {e}") from None
    except Exception as e:   # a template bug that these messages trigger (TypeError, ...)
        raise UserError(f"the model's chat template failed to render these messages "
                        f"({type(e).__name__}: {e})") from None
