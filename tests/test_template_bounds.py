"""Chat templates bounded at load (issue 76): a template's length and its tokens are bounded
before anything compiles, nothing in it runs while it compiles, whatever jinja2 or Python's
compiler raises on it is a refusal with one sentence (and the built-in ChatML instead),
`localrun info` never compiles it, and a template that renders a conversation as nothing is a
UserError (the server's 400), not an engine error."""
import json

import jinja2
import pytest
from typer.testing import CliRunner

from localrun.chat_template import CHATML, check_template, render_chat, size_refusal
from localrun.cli.main import app     # imported before any patching: it binds check_template by name
from localrun.errors import UserError
from localrun.frontend import FrontEnd
from localrun.template_sandbox import MAX_TEMPLATE_CHARS, MAX_TEMPLATE_TOKENS, BoundedEnvironment, compile_template
from synthetic_gguf import write_tiny_llama

HELLO = [{"role": "user", "content": "Hello!"}]
HELLO_CHATML = "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
REFUSED = "the model's chat template is refused: "
PYTHON_REFUSES = REFUSED + "the chat template cannot be compiled, as Python refuses the code jinja2 makes of it "


def test_a_template_at_the_length_bound_is_used_and_one_character_more_is_refused():
    at_bound = CHATML + "{#" + "x" * (MAX_TEMPLATE_CHARS - len(CHATML) - 4) + "#}"    # padded by a comment
    assert len(at_bound) == MAX_TEMPLATE_CHARS == 262_144
    assert size_refusal(at_bound) is None and check_template(at_bound) is None
    assert render_chat(at_bound, HELLO) == HELLO_CHATML
    past = at_bound + " "
    reason = REFUSED + "the chat template is 262,145 characters long, over the limit of 262,144"
    assert size_refusal(past) == check_template(past) == reason


def test_a_template_at_the_token_bound_is_used_and_one_output_more_is_refused():
    # the lexer's tokens: 'x' and 'y' are one data token each, every '{{0}}' three
    n = (MAX_TEMPLATE_TOKENS - 2) // 3
    assert 2 + 3 * n == MAX_TEMPLATE_TOKENS == 32_768
    at_bound = "x" + "{{0}}" * n + "y"
    assert check_template(at_bound) is None
    assert render_chat(at_bound, HELLO) == "x" + "0" * n + "y"
    past = "x" + "{{0}}" * (n + 1) + "y"
    assert check_template(past) == REFUSED + "the chat template has more than 32,768 tokens of template syntax, over the limit"


@pytest.mark.parametrize("template,reason", [
    # jinja2 writes each of these as Python past one of Python's own limits (issue 76, finding 7)
    ("{{ m" + "|trim" * 250 + " }}", PYTHON_REFUSES + "(too many nested parentheses)"),
    ("{% for m in messages %}" * 25 + "{{ m.content }}" + "{% endfor %}" * 25,
     PYTHON_REFUSES + "(too many statically nested blocks)"),
    ("{% if true %}" * 120 + "x" + "{% endif %}" * 120, PYTHON_REFUSES + "(too many levels of indentation)"),
    ("{% macro m(a, a) %}{% endmacro %}", PYTHON_REFUSES + "(duplicate argument 'l_1_a' in function definition)"),
    ("{{ f(a=1, a=2) }}", PYTHON_REFUSES + "(keyword argument repeated: a)"),
    # and these past the recursion limit of jinja2's own parser
    ("{% if true %}" * 1000 + "x" + "{% endif %}" * 1000, REFUSED + "the chat template is nested too deeply to compile"),
    ("{{ " + "not " * 3000 + "true }}", REFUSED + "the chat template is nested too deeply to compile"),
], ids=["250 filters", "25 nested for", "120 nested if", "duplicate argument", "repeated keyword", "1000 nested if",
        "3000 nots"])
def test_templates_python_cannot_compile_are_refused_with_one_sentence(template, reason):
    assert check_template(template) == reason
    assert render_chat(template, HELLO) == HELLO_CHATML       # the built-in ChatML instead, no traceback


def test_compile_raises_only_its_two_refusals():
    """Whatever the source, compile_template raises TemplateLimitError or jinja2's
    TemplateSyntaxError: never SyntaxError, RecursionError, ValueError, ..."""
    from localrun.template_sandbox import TemplateLimitError
    env = BoundedEnvironment(1 << 20)
    for source in ("{{ a" + "|e" * 250 + " }}", "{% if a %}" * 1000 + "{% endif %}" * 1000, "{{ 1" + "0" * 5000 + " }}",
                   "{{ (" * 150 + "{% if %}", "{% for %}" * 40, "{{ '\\N{NOPE}' }}"):
        with pytest.raises((TemplateLimitError, jinja2.exceptions.TemplateSyntaxError)):
            compile_template(env, source)


def test_nothing_in_a_template_runs_while_it_compiles():
    """jinja2 folds constant outputs (and, optimized, any constant expression) into the code while
    compiling: filters would run outside every render's limits."""
    calls = []
    env = BoundedEnvironment(1 << 20)
    env.filters["seen"] = lambda s: calls.append(s) or s
    template = compile_template(env, "{{ 'x'|seen }}{% if 'y'|seen %}{{ 1 + 2 }}{% endif %}")
    assert calls == []
    assert template.render() == "x3" and calls == ["x", "y"]


def test_constant_outputs_are_bounded_as_rendered():
    """100 outputs of a million characters each: folded, each was built while compiling, outside
    every limit, and written into the code; rendered, the output limit stops the second."""
    template = "{{ 'x'|center(1000000) }}" * 100
    assert check_template(template) == REFUSED + "the chat template's output exceeds 1,048,576 characters"


def test_a_template_that_renders_every_sample_as_nothing_is_replaced_by_chatml():
    assert check_template("{# nothing #}") == ("the model's chat template renders every sample conversation as an "
                                               "empty prompt")
    assert render_chat("{# nothing #}", HELLO) == HELLO_CHATML


class CharTokenizer:
    """One id per character of 'Helo!' (ids 0-4); BOS is id 5, written '<s>'."""
    chars = "Helo!"
    bos_id, eos_id = 5, None

    def __init__(self, add_bos: bool):
        self.add_bos = add_bos

    def token_text(self, token_id):
        return "<s>"

    def encode(self, text, *, add_special=True):
        return [self.bos_id] * add_special + [self.chars.index(c) for c in text]


CONTENT_ONLY = "{% for m in messages %}{{ m.content }}{% endfor %}"


def test_an_empty_rendered_prompt_is_a_user_error_the_server_answers_with_400():
    from localrun.server.app import prompt_error
    frontend = FrontEnd(CharTokenizer(add_bos=False), chat_template=CONTENT_ONLY, n_ctx=64, n_vocab=6)
    assert frontend.chat_ids(HELLO).ids == [0, 1, 2, 2, 3, 4]
    with pytest.raises(UserError) as e:
        frontend.chat_ids([{"role": "user", "content": ""}])
    assert str(e.value) == "the model's chat template renders these messages as an empty prompt; give a message with text"
    error = prompt_error(e.value, "messages")
    assert (error.status, error.param, error.code is not None) == (400, "messages", True)


def test_a_prompt_of_bos_alone_is_not_empty():
    frontend = FrontEnd(CharTokenizer(add_bos=True), chat_template=CONTENT_ONLY, n_ctx=64, n_vocab=6)
    assert frontend.chat_ids([{"role": "user", "content": ""}]).ids == [5]


def _refuse(*args, **kwargs):
    raise AssertionError("info lexed, parsed or compiled the chat template")


@pytest.fixture
def nothing_compiles(monkeypatch):
    """Every way to the template's compile fails the test (check_template is cached: patched too)."""
    import localrun.config
    assert localrun.config.check_template is check_template     # else restoring would keep a patch
    for target in ("localrun.template_sandbox.compile_template", "localrun.chat_template.compile_template",
                   "localrun.chat_template.check_template", "localrun.config.check_template"):
        monkeypatch.setattr(target, _refuse)
    monkeypatch.setattr(jinja2.Environment, "parse", _refuse)
    monkeypatch.setattr(jinja2.Environment, "lex", _refuse)


def run_info(path) -> dict:
    result = CliRunner().invoke(app, ["info", str(path), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize("size", [8 << 20, 1000])
def test_info_reports_the_template_from_the_header_without_compiling_it(tmp_path, nothing_compiles, size):
    """The 8 MB template of issue 76 (71 s and 4.1 GB when info compiled it): its size and the
    length bound's refusal, nothing compiled; one in bounds: its size, checked when a chat starts."""
    template = ("{{ messages }}" * size)[:size]
    fields = run_info(write_tiny_llama(tmp_path / "t.gguf", tensor_type="F32", chat_template=template))
    assert fields["chat_template_chars"] == size
    if size > MAX_TEMPLATE_CHARS:
        assert fields["chat_template"] == ("built-in ChatML (the model's chat template is refused: the chat template "
                                           "is 8,388,608 characters long, over the limit of 262,144)")
    else:
        assert fields["chat_template"] == "the file's (1,000 characters; compiled and checked when a chat starts)"


def test_info_on_files_without_a_template(tmp_path, nothing_compiles):
    fields = run_info(write_tiny_llama(tmp_path / "none.gguf", tensor_type="F32", chat_template=None))
    assert fields["chat_template"] == "built-in ChatML (the file has none)" and fields["chat_template_chars"] is None
