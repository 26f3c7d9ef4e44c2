"""Bounded chat templates (issue 22): a template from a model file cannot hang, exhaust memory,
recurse without end or reach a loader. Each hostile template is refused at load with one
sentence and the built-in ChatML template is used; `generate` never renders a template."""
import subprocess
import sys
import threading
import time

import pytest

from localrun.chat_template import CHATML, check_template, render_chat
from localrun.errors import UserError
from localrun.template_sandbox import Limits
from synthetic_gguf import write_tiny_llama

HELLO = [{"role": "user", "content": "Hello!"}]

HOSTILE = [   # (template, fragment of the refusal)
    ("{{ 7 ** 999999999 }}", "raises 7 to the power 999999999"),
    ("{{ 'x' * 10**9 }}", "repeats a value past the limit"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "time limit of 0.5 s"),
    ("{% for i in range(100000) %}{{ 'x'.ljust(1000000) }}{% endfor %}", "output exceeds 1,048,576 characters"),
    ("{{ range(10**9)|list }}", "passes range the number 1000000000"),
    ("{% include 'other.jinja' %}", "uses {% include %}, which chat templates may not"),
    ("{% import 'macros.jinja' as m %}", "uses {% import %}, which chat templates may not"),
    ("{% extends 'base.jinja' %}", "uses {% extends %}"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "nests macro calls or recursive loops more than 32 deep"),
    ("{% macro f(s, n) %}{{ f(s ~ s, n - 1) if n else s|length }}{% endmacro %}{{ f('x', 40) }}",
     "joins strings past the limit"),
    ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
     "joins strings past the limit"),
    ("{{ '%0999999999d' % 1 }}", "formats with % width 0999999999"),
    ("{{ '%(a)999999999s' % {'a': 1} }}", "formats with % width 999999999"),
    ("{{ '{:>999999999}'.format(1) }}", "formats with format width 999999999"),
    ("{{ 'x'|center(999999999) }}", "passes the center filter the number 999999999"),
    ("{{ ('x' * 100000).replace('x', 'y' * 100) }}", "replace() would build 10,000,000 characters"),
    ("{{ ['x' * 100000] * 100 | join }}", "fails on every sample conversation"),
    ("{{ (['x' * 100000] * 100) | join }}", "join would build 10,000,000 characters"),
    ("{{ 'a\tb'.expandtabs(1000000) }}", "calls str.expandtabs"),
    ("{{ 1" + "0" * 5000 + " }}", "cannot be compiled"),
    ("{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}", "nested too deeply to compile"),
    ("{% if %}", "has a syntax error (line 1: Expected an expression"),
    ("{{ raise_exception('every conversation is wrong') }}", "fails on every sample conversation"),
]


@pytest.mark.parametrize("template,fragment", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_templates_are_refused_quickly(template, fragment):
    t0 = time.perf_counter()
    reason = check_template(template)
    assert time.perf_counter() - t0 < 2.5   # three sample renders of at most 0.5 s each
    assert reason is not None and fragment in reason and "\n" not in reason and len(reason) < 300, reason
    assert render_chat(template, HELLO) == render_chat(None, HELLO)     # the built-in ChatML instead


def test_real_templates_pass_the_check():
    """Features real templates use: loop controls, namespace, macros, tojson, string methods."""
    template = ("{% set ns = namespace(n=0) %}{% macro say(m) %}<{{ m.role|upper }}>{{ m.content.strip() }}"
                "{% endmacro %}{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
                "{% set ns.n = ns.n + 1 %}{{ say(m) }}{{ '%3d' % ns.n }}{{ {'k': [1, 2]}|tojson }}{% endfor %}"
                "{% if add_generation_prompt %}<ASSISTANT>{% endif %}")
    assert check_template(template) is None
    text = render_chat(template, [{"role": "system", "content": "s"}, {"role": "user", "content": " hi "}])
    assert text == '<USER>hi  1{"k": [1, 2]}<ASSISTANT>'
    assert check_template(CHATML) is None


def test_hugging_face_generation_tag_renders_its_body():
    template = "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    assert check_template(template) is None
    assert render_chat(template, HELLO) == "[Hello!]"


def test_limits_apply_to_each_render():
    """A template fine on the samples can still go past a limit on a user's messages: a UserError."""
    quadratic = ("{% for m in messages %}{% for a in m.content %}{% for b in m.content %}{% endfor %}{% endfor %}"
                 "{% endfor %}ok")
    assert check_template(quadratic) is None
    t0 = time.perf_counter()
    with pytest.raises(UserError, match="went past a limit on these messages: .*time limit of 0.3 s"):
        render_chat(quadratic, [{"role": "user", "content": "x" * 20000}], limits=Limits(seconds=0.3))
    assert time.perf_counter() - t0 < 1.5
    with pytest.raises(UserError, match="past the limit of 1,000"):
        render_chat(CHATML, [{"role": "user", "content": "x" * 2000}], limits=Limits(max_chars=1000))


def test_render_leaves_tracing_as_it_was_and_works_in_threads():
    before = sys.gettrace()
    results = []

    def render():
        results.append(render_chat(CHATML, HELLO))

    threads = [threading.Thread(target=render) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [render_chat(CHATML, HELLO)] * 4
    assert sys.gettrace() is before


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "localrun.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def hostile_model(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("template") / "power.gguf", tensor_type="F32",
                            chat_template="{{ 7 ** 999999999 }}")


def test_model_with_hostile_template_loads_and_chats_with_chatml(hostile_model):
    from localrun import LLM
    t0 = time.perf_counter()
    llm = LLM(str(hostile_model), n_ctx=64, n_threads=1, n_parallel=1)
    ids = llm.chat_prompt_ids(HELLO)    # llama.cpp's vocabulary load no longer compiles the template
    assert time.perf_counter() - t0 < 30
    assert "raises 7 to the power 999999999" in llm.config.chat_template_error
    assert ids == llm.tokenize(render_chat(None, HELLO), add_special=False)


def test_info_reads_the_template_without_checking_it(hostile_model):
    """info is header-only: it says the file has a template and its size; the check (which
    refuses this one) is the first chat's (tests/test_template_bounds.py: info never compiles)."""
    proc = run_cli("info", str(hostile_model), "--json")
    assert proc.returncode == 0, proc.stderr
    assert "the file's (20 characters; compiled and checked when a chat starts)" in proc.stdout


def test_generate_never_renders_the_template(tmp_path):
    path = write_tiny_llama(tmp_path / "syntax.gguf", tensor_type="F32", chat_template="{% if %}{{ broken")
    proc = run_cli("generate", str(path), "-p", "The fox", "-n", "3", "--temperature", "0", "--json")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert '"finish_reason"' in proc.stdout
