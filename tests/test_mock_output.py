"""What the mock generates: minimal instances of JSON schemas, stop sequences cut as an engine
cuts them (and the decode node asked for the tokens the text takes), plausible logprobs, and the
request fields that ask for them."""

from __future__ import annotations

import json
import math
from typing import Any

import jsonschema
import pytest

from testbed.live.json_instance import SchemaError, instance
from testbed.live.mock_output import TOKEN_TEXT, plan, split_tokens, token_logprobs
from testbed.live.openai_api import RequestError, parse
from testbed.live.openai_options import generation
from testbed.live.responses_api import parse_responses

pytestmark = pytest.mark.pure

SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
    },
    {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "exclusiveMinimum": 3, "maximum": 9},
            "x": {"type": "number", "minimum": 0.5, "multipleOf": 0.25},
            "neg": {"type": "integer", "maximum": -7},
            "flag": {"type": "boolean"},
            "none": {"type": "null"},
        },
        "required": ["n", "x", "neg", "flag", "none"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "uniqueItems": True},
            "name": {"type": ["string", "null"], "minLength": 7, "maxLength": 9},
            "when": {"type": "string", "format": "date-time"},
        },
        "required": ["tags", "name", "when"],
    },
    # As pydantic writes a nested model: $defs and $ref, a const, an anyOf with null.
    {
        "$defs": {
            "Point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {
            "at": {"$ref": "#/$defs/Point"},
            "kind": {"const": "pt"},
            "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "path": {"type": "array", "items": {"$ref": "#/$defs/Point"}, "minItems": 1},
        },
        "required": ["at", "kind", "note", "path"],
    },
    {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
            {"properties": {"b": {"type": "integer", "minimum": 5}}, "required": ["b"]},
        ]
    },
]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_a_schema_instance_validates(schema: dict[str, Any]) -> None:
    value = instance(schema)
    jsonschema.validate(value, schema)
    assert json.loads(json.dumps(value)) == value


def test_instances_are_minimal_and_broken_schemas_are_named() -> None:
    assert instance({"type": "object", "properties": {"a": {"type": "string"}}}) == {}
    assert instance({"type": "object", "properties": {"a": {"type": "integer", "minimum": 4}}, "required": ["a"]}) == {
        "a": 4
    }
    for bad, words in (
        ({"$ref": "#/$defs/Nope"}, "points at nothing"),
        ({"type": "tensor"}, "unknown type"),
        ({"$ref": "#"}, "deep"),
        ({"$ref": "other.json#/x"}, "local"),
        ({"type": "string", "minLength": "3"}, "minLength"),
        ({"type": "object", "properties": ["a"], "required": ["a"]}, "malformed"),
        # minItems multiply: 1000 x 1000 values would be built without a budget.
        ({"type": "array", "minItems": 1000, "items": {"type": "array", "minItems": 1000}}, "more than"),
    ):
        with pytest.raises(SchemaError, match=words):
            instance(bad)


def test_plain_text_is_max_tokens_of_the_token_text_and_stop_cuts_it() -> None:
    out = plan(6)
    assert (out.n, out.finish, out.text()) == (6, "length", TOKEN_TEXT * 6)
    # " the the the ...": "the" completes in the first token; the client sees the space before it.
    cut = plan(6, stops=("the",))
    assert (cut.n, cut.finish, cut.text()) == (1, "stop", " ")
    # Spanning tokens: generated up to the token that completes the stop, shown up to its start.
    two = plan(6, stops=("e th",))
    assert (two.n, two.finish, two.text()) == (2, "stop", " th")
    assert two.text(1, 2) == "" and two.tokens() == [(0, " th")]
    assert plan(6, stops=("\n", "x")).finish == "length"  # never in the text: no effect
    # vLLM looks for stop sequences only from min_tokens on.
    late = plan(10, stops=(" the the",), min_tokens=5)
    assert (late.n, late.text()) == (5, TOKEN_TEXT * 3)
    assert plan(3, stops=(" the the the the",)).finish == "length"  # would complete past max_tokens


def test_structured_output_ends_with_its_json_or_at_max_tokens() -> None:
    text = json.dumps({"city": "the", "n": 2})
    out = plan(100, structured=text)
    assert (out.finish, out.text(), "".join(out.pieces)) == ("stop", text, text)
    assert out.n == len(split_tokens(text)) and all(len(p.encode()) <= 4 for p in out.pieces)
    assert plan(100, structured=text, tool="f").finish == "tool_calls"
    short = plan(3, structured=text)
    assert (short.n, short.finish, short.text()) == (3, "length", text[:12])
    padded = plan(20, structured="{}", min_tokens=5)
    assert padded.n == 5 and json.loads(padded.text()) == {}
    assert plan(8, structured="{}", ignore_eos=True).n == 8
    cut = plan(100, structured=text, stops=(",",))
    assert cut.finish == "stop" and cut.text() == '{"city": "the"'
    assert split_tokens("é€😀ab") == ("é", "€", "😀", "ab")  # never inside a character


def test_logprobs_are_plausible_and_repeatable() -> None:
    for pos, tok in enumerate((" the", '{"a"', " a")):
        lp, top = token_logprobs(tok, pos, 5)
        assert -0.6 <= lp < 0 and top[0] == (tok, lp) and len(top) == 5
        assert len({t for t, _ in top}) == 5
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True) and all(v < 0 for v in values)
        assert sum(math.exp(v) for v in values) < 1
        assert token_logprobs(tok, pos, 5) == (lp, top)
    assert len(token_logprobs(" the", 0, 20)[1]) == 20 and token_logprobs(" the", 0, 0)[1] == []


def _chat(**kw: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], **kw}


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMAS[0]}}
OTHER = {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}


def test_the_decode_node_is_asked_for_the_tokens_the_text_takes() -> None:
    req = parse(_chat(max_tokens=50, stop=" the the"), "chat")
    assert req.output_tokens == 2 and req.output.finish == "stop"
    forced = parse(
        _chat(tools=[OTHER, TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}}), "chat"
    )
    assert forced.output.tool == "get_weather" and forced.output.finish == "tool_calls"
    args = json.loads(forced.output.text())
    jsonschema.validate(args, SCHEMAS[0])
    assert forced.output_tokens == len(split_tokens(forced.output.text()))
    assert parse(_chat(max_tokens=16), "chat").output_tokens == 16  # plain text: unchanged


def test_tool_choice_decides_the_call() -> None:
    assert generation(_chat(tools=[TOOL, OTHER]), "chat").tool == "get_weather"  # auto: the first
    assert generation(_chat(tools=[TOOL], tool_choice="none"), "chat").tool is None
    assert generation(_chat(tools=[OTHER, TOOL], tool_choice="required"), "chat").tool == "other"
    # auto after a tool's result: the model answers in text.
    assert generation(_chat(tools=[TOOL]), "chat", last_is_tool_result=True).tool is None
    assert (
        generation(_chat(tools=[TOOL], tool_choice="required"), "chat", last_is_tool_result=True).tool == "get_weather"
    )
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMAS[1]}}
    jsonschema.validate(json.loads(generation(_chat(response_format=rf), "chat").structured or ""), SCHEMAS[1])
    assert generation(_chat(response_format={"type": "json_object"}), "chat").structured == "{}"
    assert generation(_chat(logprobs=True, top_logprobs=3), "chat").logprobs == 3
    assert generation(_chat(logprobs=True), "chat").logprobs == 0
    assert generation({"prompt": "x", "logprobs": 2}, "completions").logprobs == 2


@pytest.mark.parametrize(
    "body,kind,param",
    [
        (_chat(tool_choice="required"), "chat", "tool_choice"),
        (_chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}), "chat", "tool_choice"),
        (_chat(tools=[{"type": "function", "function": {"name": "bad name"}}]), "chat", "tools[0]"),
        (_chat(top_logprobs=2), "chat", "top_logprobs"),
        (_chat(logprobs=True, top_logprobs=21), "chat", "top_logprobs"),
        (_chat(stop=["ok", ""]), "chat", "stop"),
        (_chat(stop=7), "chat", "stop"),
        (_chat(response_format={"type": "yaml"}), "chat", "response_format"),
        (
            _chat(response_format={"type": "json_schema", "json_schema": {"schema": {"$ref": "#/x"}}}),
            "chat",
            "response_format.json_schema.schema",
        ),
        ({"prompt": "x", "tools": [TOOL]}, "completions", "tools"),
        ({"prompt": "x", "logprobs": True}, "completions", "logprobs"),
    ],
)
def test_bad_generation_fields_are_400s_naming_the_field(body: dict[str, Any], kind: str, param: str) -> None:
    with pytest.raises(RequestError) as e:
        parse(body, kind)
    assert e.value.param == param


def test_a_responses_body_is_parsed_as_the_chat_it_amounts_to() -> None:
    body = {
        "model": "m",
        "instructions": "be brief",
        "max_output_tokens": 7,
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hello"}]},
            {"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "sunny"},
        ],
        "tools": [{"type": "function", "name": "get_weather", "parameters": SCHEMAS[0]}],
    }
    req = parse_responses(body)
    chat = parse(_chat(max_tokens=7), "chat")
    assert req.kind == "responses" and req.output_tokens == 7
    assert req.output.tool is None  # the last item is the tool's output: text
    assert req.input_tokens > chat.input_tokens and req.extra["instructions"] == "be brief"
    called = parse_responses({**body, "input": "hi", "tool_choice": {"type": "function", "name": "get_weather"}})
    jsonschema.validate(json.loads(called.output.text()), SCHEMAS[0])
    fmt = {"format": {"type": "json_schema", "name": "x", "schema": SCHEMAS[3]}}
    jsonschema.validate(json.loads(parse_responses({"input": "hi", "text": fmt}).output.text()), SCHEMAS[3])
    for bad, param in (
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": []}, "input"),
    ):
        with pytest.raises(RequestError) as e:
            parse_responses(bad)
        assert e.value.param == param


def test_the_responses_events_of_a_tool_call_and_of_a_failure() -> None:
    from testbed.live.responses_api import ResponseEvents

    body = {
        "input": "hi",
        "tools": [{"type": "function", "name": "get_weather", "parameters": SCHEMAS[0]}],
        "tool_choice": "required",
        "stream": True,
    }
    req = parse_responses(body)
    ev = ResponseEvents(req, "resp_abc", "m")
    n = req.output_tokens
    events = ev.opening() + ev.tokens(0, 2) + ev.tokens(2, n - 2) + ev.closing(n, 0, {"testbed": {"x": 1}})
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    args = "".join(e["delta"] for e in events if e["type"].endswith(".delta"))
    jsonschema.validate(json.loads(args), SCHEMAS[0])
    final = events[-1]
    assert final["testbed"] == {"x": 1} and final["response"]["output"][0]["arguments"] == args
    assert final["response"]["output"][0]["call_id"] == "call_abc" and final["response"]["tools"] == body["tools"]
    failed = ResponseEvents(req, "resp_abc", "m").failed("decode node broke", {"testbed": {}})
    assert failed["type"] == "response.failed" and failed["response"]["error"]["message"] == "decode node broke"
