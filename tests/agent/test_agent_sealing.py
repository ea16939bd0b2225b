from kvtool.agent.backend import StreamDelta, ToolCallFragment
from kvtool.agent.sealing import CallAssembler


def frag(index, args="", id=None, name=None):
    return StreamDelta(tool_calls=[ToolCallFragment(index=index, id=id, name=name, arguments=args)])


def test_call_seals_when_its_json_is_complete():
    a = CallAssembler()
    assert a.feed(frag(0, "", id="c0", name="get_weather")) == []
    assert a.feed(frag(0, '{"city": ')) == []
    sealed = a.feed(frag(0, '"Paris"}'))
    assert [(c.id, c.name, c.arguments) for c in sealed] == [("c0", "get_weather", '{"city": "Paris"}')]
    assert a.unsealed == []


def test_brace_inside_string_does_not_seal_early():
    a = CallAssembler()
    a.feed(frag(0, "", id="c0", name="echo"))
    assert a.feed(frag(0, '{"text": "a}')) == []  # ends with } but is not complete JSON
    assert [c.arguments for c in a.feed(frag(0, ' b"}'))] == ['{"text": "a} b"}']


def test_next_index_seals_previous_call_even_if_json_incomplete():
    a = CallAssembler()
    a.feed(frag(0, '{"x": 1', id="c0", name="f"))
    sealed = a.feed(frag(1, "", id="c1", name="g"))
    assert [c.index for c in sealed] == [0]
    assert sealed[0].arguments == '{"x": 1'  # malformed: dispatch will report it


def test_finish_reason_seals_everything_open():
    a = CallAssembler()
    a.feed(frag(0, '{"a": 1', id="c0", name="f"))
    assert [c.index for c in a.feed(frag(1, '{"b": ', id="c1", name="g"))] == [0]
    assert [c.index for c in a.feed(StreamDelta(finish_reason="tool_calls"))] == [1]


def test_backend_can_seal_explicitly_like_an_in_process_engine():
    a = CallAssembler()
    a.feed(frag(0, "[1, 2", id="c0", name="f"))
    assert [c.index for c in a.feed(StreamDelta(sealed=(0,)))] == [0]


def test_missing_and_repeated_ids_are_made_unique():
    taken = {"dup"}
    a = CallAssembler(id_prefix="call_t3", taken=taken)
    a.feed(frag(0, "{}", name="f"))
    a.feed(frag(1, "{}", id="dup", name="f"))
    assert a.feed(StreamDelta(finish_reason="stop")) == []  # both already sealed by complete JSON
    assert {"call_t3_0", "dup_2"} <= taken


def test_late_fragments_after_seal_are_reported_not_merged():
    a = CallAssembler()
    a.feed(frag(0, "{}", id="c0", name="f"))
    a.feed(frag(0, "  "))
    assert a.late_fragments == {}
    a.feed(frag(0, "x"))
    assert a.late_fragments == {0: "  x"}


def test_as_message_call_replaces_malformed_arguments():
    a = CallAssembler()
    a.feed(frag(0, '{"x": ', id="c0", name="f"))
    call = a.finish()[0]
    assert call.as_message_call()["function"]["arguments"] == "{}"
