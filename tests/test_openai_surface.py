"""The OpenAI surface as the `openai` package sees it, against an in-process router: `stop`,
`logprobs`, forced tool calls, `response_format` json_schema, the Responses API streaming and
not, `models.retrieve`, and OpenAI error bodies for what is not emulated. The records and the
decode node stay consistent with what was generated."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import creds
import jsonschema
import pytest

from testbed.config.scenarios import load_scenario
from testbed.deploy.inproc import InProcessBackend
from testbed.deploy.plan import loopback_deployment
from testbed.live.openai_api import TOKEN_TEXT
from testbed.run.load import resolve

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.clients

MESSAGES = [{"role": "user", "content": "what is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 2},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "where": {
            "type": "object",
            "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
            "required": ["lat", "lon"],
        },
        "hours": {"type": "array", "items": {"type": "integer"}, "minItems": 2},
    },
    "required": ["city", "unit", "days", "where", "hours"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": WEATHER}},
]


class Router:
    def __init__(self, url: str, model: str, decode_urls: list[str], headers: dict[str, str]) -> None:
        self.url, self.model, self.decode_urls, self.headers = url, model, decode_urls, headers
        key = headers["Authorization"].removeprefix("Bearer ")
        self.client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


@pytest.fixture
async def router() -> AsyncIterator[Router]:
    sc = load_scenario(
        "paper-prfaas", {"scale": {"speedup": 40, "byte_scale": 1024}, "serving": {"stream_interval": 2}}
    )
    dep = loopback_deployment(resolve(sc), None)
    async with InProcessBackend(dep) as d:
        r = Router(
            d.router.url,
            sc.model.name,
            [n.http.url for n in dep.nodes.values() if n.role == "decode"],
            creds.headers(dep),
        )
        yield r
        await r.client.close()


async def test_stop_ends_the_stream_and_the_decode_work_where_the_stop_sequence_is(router: Router) -> None:
    # min_tokens (vLLM's) keeps the stop from firing before token 5: " the the" then completes
    # in token 5, and the client sees the text before it.
    stream = await router.client.chat.completions.create(
        model="m",
        messages=MESSAGES,
        max_tokens=40,
        stop=[" the the", "\n"],
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"min_tokens": 5},
        extra_headers={"X-Request-Id": "stop-1"},
    )
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == TOKEN_TEXT * 3
    # Tokens 4 and 5 show nothing (the stop sequence starts in token 4): no empty chunk for them.
    assert all(c.choices[0].delta.content or c.choices[0].finish_reason for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    one = await router.client.completions.create(model="m", prompt="x", max_tokens=9, stop="the")
    assert (one.choices[0].text, one.choices[0].finish_reason, one.usage.completion_tokens) == (" ", "stop", 1)
    plain = await router.client.completions.create(model="m", prompt="x", max_tokens=4, stop=["\n"])
    assert (plain.choices[0].text, plain.choices[0].finish_reason) == (TOKEN_TEXT * 4, "length")
    # The record (the last content chunk's `testbed` field): 5 tokens asked of the decode node, 5 sent.
    rec = [c for c in chunks if c.choices][-1].model_extra["testbed"]
    assert (rec["outcome"], rec["output_tokens"], rec["tokens_received"]) == ("completed", 5, 5)
    async with aiohttp.ClientSession(headers=router.headers) as s:
        async with s.get(f"{router.url}/testbed/info") as r:
            assert (await r.json())["tokens_per_chunk"] == 2
        for url in router.decode_urls:
            async with s.get(f"{url}/status") as r:
                assert (await r.json())["running"] == 0


async def test_logprobs_match_the_text_streaming_and_not(router: Router) -> None:
    stream = await router.client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=3, stream=True
    )
    chunks = [c async for c in stream]
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(entries) == 5 and "".join(e.token for e in entries) == text
    for e in entries:
        tops = [t.logprob for t in e.top_logprobs]
        assert e.logprob < 0 and len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert e.top_logprobs[0].token == e.token and bytes(e.bytes or []) == e.token.encode()
    full = await router.client.completions.create(model="m", prompt="x", max_tokens=3, logprobs=2)
    lp = full.choices[0].logprobs
    assert lp is not None and "".join(lp.tokens or []) == full.choices[0].text
    assert lp.text_offset == [0, 4, 8] and all(len(d) == 2 for d in lp.top_logprobs or [])
    plain = await router.client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    assert plain.choices[0].logprobs is None


async def test_a_forced_tool_call_validates_against_its_schema(router: Router) -> None:
    forced = {"type": "function", "function": {"name": "get_weather"}}
    r = await router.client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice=forced)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert r.usage is not None and 1 < r.usage.completion_tokens < 100
    stream = await router.client.chat.completions.create(
        model="m", messages=MESSAGES, tools=TOOLS, tool_choice=forced, stream=True
    )
    deltas = [c.choices[0] async for c in stream if c.choices]
    pieces = [tc for d in deltas for tc in d.delta.tool_calls or []]
    assert pieces[0].id and pieces[0].function.name == "get_weather" and len(pieces) > 2
    assert json.loads("".join(p.function.arguments or "" for p in pieces)) == json.loads(call.function.arguments)
    assert deltas[-1].finish_reason == "tool_calls"
    with pytest.raises(openai.BadRequestError) as e:
        await router.client.chat.completions.create(
            model="m", messages=MESSAGES, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}
        )
    assert e.value.body["param"] == "tool_choice"


async def test_response_format_json_schema_gives_valid_json(router: Router) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
    r = await router.client.chat.completions.create(model="m", messages=MESSAGES, response_format=fmt)
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), WEATHER)
    assert r.choices[0].finish_reason == "stop"
    obj = await router.client.chat.completions.create(
        model="m", messages=MESSAGES, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)


async def test_the_responses_api_streaming_and_not(router: Router) -> None:
    r = await router.client.responses.create(
        model=router.model, input="hello", instructions="be brief", max_output_tokens=6
    )
    assert r.output_text == TOKEN_TEXT * 6 and r.usage is not None and r.usage.output_tokens == 6
    assert r.status == "incomplete" and r.incomplete_details is not None  # the mock always runs to the limit
    stream = await router.client.responses.create(
        model=router.model, input="hello", max_output_tokens=5, stream=True, extra_headers={"X-Request-Id": "resp-1"}
    )
    events = [ev async for ev in stream]
    types = [ev.type for ev in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert "".join(ev.delta for ev in events if ev.type == "response.output_text.delta") == TOKEN_TEXT * 5
    assert [ev.sequence_number for ev in events] == list(range(len(events)))
    assert events[-1].response.output[0].content[0].text == TOKEN_TEXT * 5
    schema_fmt = {"format": {"type": "json_schema", "name": "weather", "schema": WEATHER}}
    js = await router.client.responses.create(model=router.model, input="hello", text=schema_fmt)
    assert js.status == "completed"
    jsonschema.validate(json.loads(js.output_text), WEATHER)
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER}
    call = await router.client.responses.create(model=router.model, input="hello", tools=[tool], tool_choice="required")
    assert call.output[0].type == "function_call"
    jsonschema.validate(json.loads(call.output[0].arguments), WEATHER)
    rec = events[-1].model_extra["testbed"]
    assert (rec["request_id"], rec["outcome"], rec["output_tokens"], rec["tokens_received"]) == (
        "resp-1",
        "completed",
        5,
        5,
    )
    assert rec["router_arrival"] < rec["decode_first_token"] < rec["decode_last_token"]


async def test_models_retrieve_and_json_errors_for_what_is_not_emulated(router: Router) -> None:
    m = await router.client.models.retrieve(router.model)
    assert m.id == router.model
    with pytest.raises(openai.NotFoundError) as nf:
        await router.client.models.retrieve("gpt-nothing")
    assert nf.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as emb:
        await router.client.embeddings.create(model="m", input="x")
    assert "not emulated" in emb.value.body["message"]
    async with aiohttp.ClientSession(headers=router.headers) as s:
        for method, path, status in (
            ("POST", "/v1/nope", 404),
            ("GET", "/v1/chat/completions", 405),
            ("DELETE", "/v1/responses", 405),
            ("POST", "/v1/images/generations", 404),
        ):
            async with s.request(method, router.url + path, json={}) as r:
                assert r.status == status and r.content_type == "application/json", (path, await r.text())
                body: dict[str, Any] = await r.json()
                assert set(body["error"]) == {"message", "type", "param", "code"}
        async with s.post(f"{router.url}/v1/chat/completions", data="{nope") as r:
            assert r.status == 400 and set((await r.json())["error"]) == {"message", "type", "param", "code"}
