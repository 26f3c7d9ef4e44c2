"""Structured output (issue 19): JSON schemas and grammars enforced by a token mask, failing closed.

Every output is parsed and validated with the `jsonschema` package against its schema: 20
schemas on a tiny random-weight model sampled at temperature 1 (the mask alone makes it valid,
whatever the weights), and the same 20 through the official openai SDK on the real model."""
from __future__ import annotations

import concurrent.futures
import json
import re

import jsonschema
import pytest

from localrun.api import LLM
from localrun.grammar import GrammarError, check_schema

S = {"type": "string", "maxLength": 24}
SCHEMAS = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": -10, "maximum": 10}, "y": {"type": "number", "minimum": -10, "maximum": 10}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"score": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}},
     "required": ["score"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "event"}, "id": {"type": "integer", "minimum": 1000,
                                                                          "maximum": 9999}},
     "required": ["kind", "id"], "additionalProperties": False},
    {"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 16}}, "required": ["note"],
     "additionalProperties": False},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99},
                                                          {"type": "boolean"}]}},
     "required": ["value"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": S, "address": {"type": "object", "properties": {"city": S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                               "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False}}, "required": ["user"],
     "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"sku": S, "qty": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"],
     "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "minLength": 3, "maxLength": 5}}, "required": ["code"],
     "additionalProperties": False},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date"}}, "required": ["when"],
     "additionalProperties": False},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]},
                                      "label": {"enum": ["low", "mid", "high", None]}},
     "required": ["level", "label"], "additionalProperties": False},
    {"type": "object", "$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                                                              "maximum": 9}},
                                        "required": ["x"], "additionalProperties": False}},
     "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}}, "required": ["a", "b"],
     "additionalProperties": False},
    {"type": "object", "properties": {"pair": {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0,
                                                                                 "maximum": 9}, {"type": "boolean"}],
                                               "items": False}},
     "required": ["pair"], "additionalProperties": False},
    {"type": "object", "properties": {"name": S, "email": {"type": "string", "format": "email", "maxLength": 40}},
     "required": ["name", "email"], "additionalProperties": False},
    {"type": "object", "properties": {"title": S, "done": {"type": "boolean"}, "priority": {"enum": ["p1", "p2"]},
                                      "estimate": {"type": "number", "minimum": 0, "maximum": 100},
                                      "subtasks": {"type": "array", "maxItems": 2, "items": S}},
     "required": ["title", "done", "priority", "estimate", "subtasks"], "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": -5, "maximum": 5}}}},
     "required": ["matrix"], "additionalProperties": False},
]
assert len(SCHEMAS) == 20


@pytest.fixture(scope="module")
def tiny(tiny_gguf):
    return LLM(tiny_gguf("F32", context_length=1024), dtype="float32", n_threads=1, n_parallel=4)


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_tiny_model_output_validates_against_each_schema(tiny, index):
    """Random weights at temperature 1, three seeds: only the mask makes the output valid. A
    reply that stops parses and validates. A reply cut at max_tokens (JSON numbers have no
    length bound, and a random model may write digits for ever: which seed does so changes with
    how the sampler draws) is a prefix the grammar accepted token by token. At least one reply
    of the three stops, so validation always runs."""
    schema = SCHEMAS[index]
    results = tiny.generate("data:", n=3, json_schema=schema, temperature=1.0, seed=index, max_tokens=400)
    for r in results:
        if r.finish_reason == "stop":
            jsonschema.validate(json.loads(r.text), schema)
            continue
        assert r.finish_reason == "length" and len(r.token_ids) == 400, r.finish_reason
        matcher = tiny.grammar_compiler.json_schema(schema).new_matcher()
        for token_id in r.token_ids:
            matcher.consume(token_id)               # raises on a token the grammar refuses
    assert any(r.finish_reason == "stop" for r in results)


def test_without_the_mask_the_tiny_model_writes_no_json(tiny):
    """The reference point: the same requests unmasked do not parse."""
    results = tiny.generate("data:", n=3, temperature=1.0, seed=0, max_tokens=40)
    for r in results:
        with pytest.raises(ValueError):
            json.loads(r.text)


def test_gbnf_grammar_is_enforced(tiny):
    grammar = 'root ::= ("yes" | "no") " " [0-9] [0-9]?'
    for r in tiny.generate("answer:", n=4, grammar=grammar, temperature=1.0, seed=3, max_tokens=20):
        assert re.fullmatch(r"(yes|no) [0-9][0-9]?", r.text), r.text


def test_a_complete_grammar_ends_the_reply_even_with_ignore_eos(tiny):
    r = tiny.generate("x", grammar='root ::= "yes" | "no"', ignore_eos=True, max_tokens=10, temperature=1.0, seed=1)
    assert r.text in ("yes", "no") and r.finish_reason == "stop"


def test_compiled_grammars_are_cached_by_schema(tiny):
    compiler = tiny.grammar_compiler
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    first = compiler.json_schema(schema)
    count = compiler.num_compiled
    same = compiler.json_schema(json.loads(json.dumps(schema)))      # an equal schema, another object
    assert same is first and compiler.num_compiled == count
    assert compiler.json_schema({"type": "object"}) is not first


def test_properties_come_out_in_the_schema_order(tiny):
    """The output lists properties as the schema orders them (the cache key keeps that order)."""
    for order in (["b", "a"], ["a", "b"]):
        schema = {"type": "object", "properties": {k: {"type": "integer", "minimum": 0, "maximum": 9} for k in order},
                  "required": order, "additionalProperties": False}
        text = tiny.generate("x", json_schema=schema, temperature=1.0, seed=1, max_tokens=40).text
        assert list(json.loads(text)) == order


UNSUPPORTED = [
    ({"type": "object", "patternProperties": {"^a": {}}}, "patternProperties"),
    ({"type": "object", "minProperties": 1}, "minProperties"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains"),
    ({"type": "integer", "multipleOf": 3}, "multipleOf"),
    ({"if": {"type": "string"}, "then": {"maxLength": 2}}, "if"),
    ({"not": {"type": "string"}}, "not"),
    ({"type": "object", "properties": {"a": {"type": "string", "contentEncoding": "base64"}}}, "contentEncoding"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "string", "format": "hostname"}, "hostname"),
    ({"$ref": "https://example.com/schema.json"}, "local references"),
    ({"type": "strng"}, "strng"),
    ({"type": "object", "properties": {"deep": {"type": "array", "items": {"type": "object", "propertyNames": {}}}}},
     "propertyNames"),
]


@pytest.mark.parametrize("schema,named", UNSUPPORTED, ids=[u[1] for u in UNSUPPORTED])
def test_unsupported_keywords_are_refused_by_name(tiny, schema, named):
    with pytest.raises(GrammarError, match=re.escape(named)) as e:
        check_schema(schema)
    assert e.value.field == "json_schema"
    with pytest.raises(GrammarError, match=re.escape(named)):
        tiny.generate("x", json_schema=schema, max_tokens=2)


# --- the real model through the official SDK --------------------------------------------------
@pytest.mark.model
def test_real_model_json_schema_outputs_validate_through_the_sdk():
    import openai

    from localrun.models import resolve_model
    from localrun.server.app import ServerConfig, create_app
    from server_harness import running
    llm = LLM(resolve_model(None), n_ctx=2048, n_parallel=4)
    with running(create_app(llm, ServerConfig("smollm2-135m"))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)

        def ask(schema):
            return client.chat.completions.create(
                model="gpt-4o-mini", max_tokens=400, temperature=0,
                messages=[{"role": "user", "content": "Reply with an example JSON value for this schema: "
                                                      + json.dumps(schema)}],
                response_format={"type": "json_schema", "json_schema": {"name": "out", "schema": schema,
                                                                        "strict": True}})
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(ask, SCHEMAS))
        for schema, reply in zip(SCHEMAS, replies):
            assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
            jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
        # JSON mode: any object
        obj = client.chat.completions.create(
            model="smollm2-135m", max_tokens=400, temperature=0, response_format={"type": "json_object"},
            messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}])
        assert obj.choices[0].finish_reason == "stop", obj.choices[0].message.content
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
        # llama.cpp's form: json_object carrying a schema, which is enforced, not ignored
        schema = SCHEMAS[2]
        r = client.chat.completions.create(model="x", max_tokens=50, temperature=0, messages=[
            {"role": "user", "content": "Pick a color."}], response_format={"type": "json_object", "schema": schema})
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_python_api_options(tiny):
    schema = SCHEMAS[2]
    text = tiny.generate("x", json_schema=json.dumps(schema), temperature=1.0, seed=2, max_tokens=40).text
    jsonschema.validate(json.loads(text), schema)                 # JSON text works as a dict does
    with pytest.raises(GrammarError, match="not both"):
        tiny.generate("x", json_schema=schema, grammar='root ::= "a"')
    with pytest.raises(GrammarError, match="not valid JSON"):
        tiny.generate("x", json_schema="{oops")


def test_plain_generation_never_builds_the_grammar_compiler(tiny_gguf):
    """The compiler walks the whole vocabulary (1.6 s for a 262k one): a request without a
    schema or grammar must not pay for it."""
    llm = LLM(tiny_gguf("F32"), n_threads=1)
    llm.generate("hello", max_tokens=2, temperature=0)
    assert "grammar_compiler" not in vars(llm.frontend)      # the front end builds it on first use
    llm.generate("hello", max_tokens=2, temperature=0, json_schema={"type": "object"})
    assert "grammar_compiler" in vars(llm.frontend)
