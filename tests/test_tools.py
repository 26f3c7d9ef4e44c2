"""Tool calling (issue 19): tools rendered by the GGUF's template, calls parsed per template
family, tool_choice required/named enforced by a grammar, streamed `tool_calls` deltas that the
official openai SDK accumulates, `role: tool` messages back into the template."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from localrun.api import LLM
from localrun.errors import UserError
from localrun.server.app import ServerConfig, create_app
from localrun.tools import ToolStream, family, parse_calls, supports_tools
from server_harness import running

# a Hermes/Qwen-style template, as such GGUFs carry it (simplified)
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call functions.\n<tools>\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    "Call one as <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n</tool_call><|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant"
    "{%- for tc in message.tool_calls %}\n<tool_call>\n"
    "{{ {'name': tc.function.name, 'arguments': tc.function.arguments} | tojson }}\n</tool_call>{%- endfor %}"
    "<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "integer", "minimum": -12, "maximum": 12}}, "required": ["zone"],
        "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def llm(tiny_gguf):
    return LLM(tiny_gguf("F32", context_length=1024, chat_template=HERMES_TEMPLATE), dtype="float32",
               n_threads=1, n_parallel=4)


@pytest.fixture(scope="module")
def client(llm):
    with running(create_app(llm, ServerConfig("tiny-tools"))) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def check_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in (names or SCHEMAS)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# --- parsing and family detection ---------------------------------------------------------------
def test_family_from_the_template():
    assert family(HERMES_TEMPLATE) == "hermes" and supports_tools(HERMES_TEMPLATE)
    assert family("{{ '<|python_tag|>' }}{% if tools %}{% endif %}") == "llama3"
    assert family("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]") == "mistral"
    assert not supports_tools("{% for m in messages %}{{ m.content }}{% endfor %}")


def test_parse_each_family():
    names = {"get_weather", "get_time"}
    content, calls = parse_calls('Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                                 '"unit": "c"}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": '
                                 '{"zone": 1}}</tool_call>', "hermes", names)
    assert content == "Sure." and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "unit": "c"}
    content, calls = parse_calls('<|python_tag|>{"name": "get_time", "parameters": {"zone": 2}}', "llama3", names)
    assert content is None and calls[0].name == "get_time" and json.loads(calls[0].arguments) == {"zone": 2}
    content, calls = parse_calls('[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": 3}}]', "mistral", names)
    assert calls[0].name == "get_time" and json.loads(calls[0].arguments) == {"zone": 3}
    content, calls = parse_calls('[TOOL_CALLS]get_time[ARGS]{"zone": 4}', "mistral", names)
    assert json.loads(calls[0].arguments) == {"zone": 4}
    # an unknown name or broken JSON is not a call: the text stays content
    for text, fam in [('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "hermes"),
                      ('{"name": "get_time", "parameters": {', "llama3"), ("plain answer", "mistral")]:
        assert parse_calls(text, fam, names) == (text, [])


def test_tool_stream_holds_back_a_call_and_nothing_else():
    stream = ToolStream("hermes", forced=False)
    shown = "".join(stream.feed(piece) for piece in ["Let me ", "check <tool", "_call>\n{\"name\"", ": 1}"])
    assert shown == "Let me check "
    plain = ToolStream("hermes", forced=False)
    assert "".join(plain.feed(p) for p in ["a <b", "c> d"]) == "a <bc> d"
    llama = ToolStream("llama3", forced=False)
    assert llama.feed("  {\"name\"") == "" and llama.capturing


# --- the server, through the SDK -------------------------------------------------------------------
def test_required_yields_a_valid_call_whole(client):
    for seed in range(3):
        r = client.chat.completions.create(model="gpt-4o", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           temperature=1.0, seed=seed, max_tokens=200, parallel_tool_calls=False)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        check_calls(choice.message.tool_calls)


def test_required_yields_a_valid_call_streamed_through_the_sdk_accumulator(client):
    with client.chat.completions.stream(model="gpt-4o", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                        temperature=1.0, seed=4, max_tokens=200, parallel_tool_calls=False) as stream:
        deltas = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message.tool_calls)
    assert [d.name for d in deltas] == [c.function.name for c in choice.message.tool_calls]
    # the same request whole gives the same call (same seed): streaming changes nothing
    whole = client.chat.completions.create(model="gpt-4o", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           temperature=1.0, seed=4, max_tokens=200, parallel_tool_calls=False)
    assert [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_named_tool_choice_calls_that_function(client):
    r = client.chat.completions.create(model="x", messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=1,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       parallel_tool_calls=False, max_tokens=100)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1
    check_calls(calls, names={"get_time"})


def test_bad_tool_requests_are_400_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="x", messages=MESSAGES, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice" and "nope" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}]
        client.chat.completions.create(model="x", messages=MESSAGES, tools=bad, tool_choice="required")
    assert e.value.body["param"] == "tools" and "'not'" in e.value.message


def test_tool_messages_flow_back_into_the_template(client, llm):
    """An assistant's call and the tool's answer render through the template, as given."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "unit": "c"}'}}
    messages = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call]},
                           {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    r = client.chat.completions.create(model="x", messages=messages, tools=TOOLS, max_tokens=2, temperature=0)
    expected = llm.chat_prompt_ids(MESSAGES + [
        {"role": "assistant", "content": "", "tool_calls": [{**call, "function": {
            "name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}], tools=TOOLS)
    text = llm.detokenize(expected)
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in text
    assert '"arguments": {"city": "Paris", "unit": "c"}' in text and '"name": "get_weather"' in text
    assert r.usage.prompt_tokens == len(expected)


def test_python_api_chat_with_tools(tiny_gguf):
    llm = LLM(tiny_gguf("F32", context_length=1024, chat_template=HERMES_TEMPLATE), dtype="float32",
              n_threads=1, n_parallel=1)      # its own engine: the server's runs in its own thread
    result = llm.chat(MESSAGES, tools=TOOLS, tool_choice="required", temperature=1.0, seed=2, max_tokens=200,
                      parallel_tool_calls=False)
    assert result.finish_reason == "tool_calls" and result.tool_calls
    for call in result.tool_calls:
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
    with pytest.raises(UserError, match="tool_choice"):
        llm.chat(MESSAGES, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})


def test_tools_with_a_template_that_takes_none_is_refused(tiny_gguf):
    plain = LLM(tiny_gguf("F32", context_length=1024), dtype="float32", n_threads=1, n_parallel=1)
    with pytest.raises(UserError, match="does not take tools"):
        plain.chat(MESSAGES, tools=TOOLS)


def test_auto_streams_the_same_content_as_whole(client):
    """tool_choice auto on a model that answers in text: streamed content (through the hold-back
    of possible call starts) equals the whole reply, and no call is invented."""
    kwargs = dict(model="x", messages=MESSAGES, tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=24)
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.message.tool_calls is None and whole.finish_reason in ("stop", "length")
    assert streamed == whole.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.finish_reason


def test_streamed_calls_go_out_as_each_closes():
    """hermes: a call is sent as soon as its </tool_call> arrives, not at the end of the reply."""
    from localrun.server.engine_loop import Event
    from localrun.server.responses import Choice
    from localrun.tools import ToolPlan
    plan = ToolPlan(TOOLS, "hermes", set(SCHEMAS))
    choice = Choice(0, plan)
    pieces = ["Checking. <tool_", "call>\n{\"name\": \"get_time\", \"arguments\": {\"zone\": 1}}\n</tool",
              "_call>\n<tool_call>\n{\"name\": \"get_weather\", ", "\"arguments\": {\"city\": \"Oslo\", \"unit\": \"c\"}}",
              "\n</tool_call>"]
    sent = []
    for piece in pieces:
        choice.feed(Event("text", text=piece))
        sent.append([c.name for c in choice.new_calls(final=False)])
    assert sent == [[], [], ["get_time"], [], ["get_weather"]]
    assert choice.new_calls(final=True) == []
    content, calls = choice.finish()
    assert content == "Checking." and [c.name for c in calls] == ["get_time", "get_weather"]


@pytest.mark.parametrize("fam", ["hermes", "llama3", "mistral"])
def test_each_family_forced_call_parses_back_to_valid_calls(tiny_gguf, fam):
    """The grammar a forced call uses, per family, produces text that family's parser reads back
    as calls whose arguments follow the schema (random weights, temperature 1: the mask does it)."""
    from localrun.tools import call_grammar
    llm = LLM(tiny_gguf("F32", context_length=1024, chat_template=HERMES_TEMPLATE), dtype="float32",
              n_threads=1, n_parallel=4)
    constraint = llm.grammar_compiler.lark(call_grammar(TOOLS, fam, parallel=False)[0], "tools")
    for r in llm.generate("call:", n=3, constraint=constraint, temperature=1.0, seed=7, max_tokens=300):
        assert r.finish_reason == "stop", r.text
        content, calls = parse_calls(r.text, fam, set(SCHEMAS))
        assert len(calls) == 1 and not content, r.text
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
