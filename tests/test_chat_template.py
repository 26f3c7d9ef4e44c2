"""Chat templates rendered with jinja2, against hand-written expected prompts."""
import pytest

from localrun.chat_template import CHATML, render_chat
from localrun.errors import UserError

SMOLLM2_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
                    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
                    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_chatml_with_generation_prompt():
    text = render_chat(CHATML, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_smollm2_template_adds_default_system_prompt():
    text = render_chat(SMOLLM2_TEMPLATE, [{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_template_exceptions_become_user_errors():
    template = ("{% if messages|length > 1 and messages[0]['role'] == messages[1]['role'] %}"
                "{{ raise_exception('roles must alternate') }}{% endif %}" + CHATML)
    with pytest.raises(UserError, match="roles must alternate"):
        render_chat(template, [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}])


def test_a_template_that_always_raises_is_replaced_by_chatml():
    """Refused at load (it fails on every sample conversation): the built-in template is used."""
    template = "{{ raise_exception('no conversation is right') }}"
    assert render_chat(template, [{"role": "user", "content": "x"}]) == render_chat(CHATML, [{"role": "user", "content": "x"}])


@pytest.mark.parametrize("messages", [[], "hello", [{"content": "no role"}], [{"role": "wizard", "content": "x"}],
                                      [{"role": "user", "content": 5}]])
def test_bad_messages_are_user_errors(messages):
    with pytest.raises(UserError):
        render_chat(CHATML, messages)
