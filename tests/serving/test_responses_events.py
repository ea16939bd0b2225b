"""The Responses event order for a reasoning model's output (reasoning, text, two tool calls) from scripted chat
chunks, without a model, checked by the official `openai` client's own stream accumulator; and the output
items turned back into the chat turns a previous_response_id follow-up renders; the bounded store. (The
real-model runs are in test_serve_responses.py.)"""

from __future__ import annotations

import asyncio

import pytest
from openai import NOT_GIVEN
from openai._models import construct_type_unchecked
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from kvtool.serving.responses import ResponseNotFound, ResponseStore
from kvtool.serving.responses_input import ResponsesRequest, input_messages
from kvtool.serving.responses_stream import ResponseWriter


def chunk(delta: dict | None = None, finish: str | None = None, **extra) -> dict:
    return {"choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}


CHUNKS = [chunk({"role": "assistant", "content": ""}), chunk({"reasoning_content": "Paris and Rome"}),
          chunk({"reasoning_content": ": two calls."}), chunk({"content": "Checking."}),
          chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                 "function": {"name": "get_weather", "arguments": ""}}]}),
          chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]}),
          chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                                 "function": {"name": "get_weather", "arguments": ""}}]}),
          chunk({"tool_calls": [{"index": 1, "function": {"arguments": '{"city": "Rome"}'}}]}),
          chunk({}, "tool_calls", timings={"ttft_ms": 1.0}),
          chunk(None, usage={"prompt_tokens": 10, "completion_tokens": 20, "total_tokens": 30,
                             "prompt_tokens_details": {"cached_tokens": 8},
                             "completion_tokens_details": {"reasoning_tokens": 6}})]


def events_of(chunks: list[dict]) -> tuple[ResponseWriter, list[dict]]:
    writer = ResponseWriter("m", ResponsesRequest(input="Weather in Paris and Rome?"))

    async def source():
        for c in chunks:
            yield c

    async def collect():
        return [ev async for ev in writer.events(source())]

    return writer, asyncio.run(collect())


def test_items_open_and_close_in_the_order_the_model_wrote_them():
    writer, events = events_of(CHUNKS)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    items = [(e["type"].rsplit(".", 1)[1], e["item"]["type"]) for e in events if ".output_item." in e["type"]]
    assert items == [("added", "reasoning"), ("done", "reasoning"), ("added", "message"), ("done", "message"),
                     ("added", "function_call"), ("done", "function_call"),
                     ("added", "function_call"), ("done", "function_call")]
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.count("response.reasoning_text.delta") == 2 and "response.reasoning_text.done" in kinds
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call", "function_call"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "Paris and Rome: two calls."}]
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 8
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 6 and final["timings"] == {"ttft_ms": 1.0}
    assert writer.status == "completed"

    # the official client's accumulator takes the stream as it takes OpenAI's
    state = ResponseStreamState(input_tools=NOT_GIVEN, text_format=NOT_GIVEN)
    for ev in events:
        state.handle_event(construct_type_unchecked(type_=ResponseStreamEvent, value=ev))
    done = state._completed_response
    assert [o.type for o in done.output] == ["reasoning", "message", "function_call", "function_call"]
    assert done.output[3].arguments == '{"city": "Rome"}' and done.output_text == "Checking."


def test_output_items_are_one_assistant_turn_with_its_reasoning_and_calls():
    _, events = events_of(CHUNKS)
    turns = input_messages(events[-1]["response"]["output"], "output")
    assert turns == [{"role": "assistant", "content": "Checking.", "reasoning_content": "Paris and Rome: two calls.",
                      "tool_calls": [
                          {"id": "call_a", "type": "function",
                           "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                          {"id": "call_b", "type": "function",
                           "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]}]


def test_running_out_of_tokens_is_incomplete_and_an_engine_error_fails():
    writer, events = events_of([chunk({"content": "Hel"}), chunk({}, "length"), chunk(None, usage=None)])
    assert events[-1]["type"] == "response.incomplete" and writer.incomplete == {"reason": "max_output_tokens"}
    assert events[-2]["item"]["status"] == "incomplete"
    writer, events = events_of([chunk({"content": "Hel"}), {"error": {"message": "boom", "code": None}}])
    assert events[-1]["type"] == "response.failed" and events[-1]["response"]["error"]["message"] == "boom"
    assert writer.failure is not None and events[-2]["type"] == "response.output_item.done"


def test_the_store_keeps_the_newest_and_names_what_it_lacks():
    store = ResponseStore(2)
    for i in range(3):
        store.put({"id": f"resp_{i}"}, [{"role": "user", "content": str(i)}])
    assert list(store.items) == ["resp_1", "resp_2"] and store.get("resp_2")[1][0]["content"] == "2"
    with pytest.raises(ResponseNotFound, match="store=false, or it is older than the 2 responses") as err:
        store.get("resp_0", "previous_response_id")
    assert err.value.param == "previous_response_id" and err.value.status_code == 404
    store.delete("resp_1")
    assert list(store.items) == ["resp_2"]
    nothing = ResponseStore(0)
    nothing.put({"id": "resp_x"}, [])
    assert not nothing.items
