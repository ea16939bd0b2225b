"""The Python API names what is wrong with its arguments (InvalidParameterError), as the CLI and server do."""

import numpy as np
import pytest
import torch

from kvtool import SamplingParams
from kvtool.config import EngineConfig, as_sampling_params
from kvtool.engine import Engine
from kvtool.engine.scheduler import BatchScheduler
from kvtool.errors import InvalidParameterError
from kvtool.ids import as_token_ids


@pytest.mark.parametrize("value,words", [
    ("hello", "prompt is str, not token ids; encode text first"),
    (b"\x01", "prompt is bytes, not token ids"),
    (None, "prompt must be a list of token ids; got NoneType"),
    (7, "prompt must be a list of token ids; got int"),
    ([1.5, 2], "prompt must hold integer token ids; got 1.5 (float)"),
    ([1, 2.0], "got 2.0 (float)"),
    ([True, 5], "got True (bool)"),
    ([[1, 2]], "got [1, 2] (list)"),
    (np.zeros((2, 2), dtype=np.int64), "1-D token ids; got an array of shape (2, 2)"),
    (torch.tensor([1.0, 2.0]), "got 1.0 (float)"),
])
def test_token_ids_that_are_not_refused_with_the_reason(value, words):
    with pytest.raises(InvalidParameterError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        as_token_ids(value)


def test_token_ids_from_arrays_tensors_and_ranges():
    assert as_token_ids(np.array([3, 4], dtype=np.int32)) == [3, 4]
    assert as_token_ids(torch.tensor([5, 6])) == [5, 6]
    assert as_token_ids(range(2)) == [0, 1]
    assert all(type(t) is int for t in as_token_ids(np.array([1, 2])))


@pytest.mark.parametrize("kwargs,words", [
    (dict(temperature="0.5"), "temperature='0.5': must be a number"),
    (dict(top_p="high"), "top_p='high': must be a number or None \\(the model's default\\)"),
    (dict(repetition_penalty=True), "repetition_penalty=True: must be a number"),
    (dict(ignore_eos="no"), "ignore_eos='no': must be true or false"),
    (dict(max_tokens=True), "max_tokens=True: must be an integer >= 1"),
    (dict(top_k=False), "top_k=False: must be an integer >= 0"),
    (dict(seed=True), "seed=True: must be an integer"),
    (dict(stop=5), "stop=5: must be a list of non-empty strings"),
    (dict(stop_token_ids=5), "stop_token_ids=5: must be a list of token ids"),
    (dict(stop_token_ids=[True]), "stop_token_ids=\\[True\\]: must be a list of token ids"),
    (dict(response_format=["text"]), "response_format=\\['text'\\]: must be 'text'"),
    (dict(response_format="json_schema", json_schema="{}"),
     "json_schema='{}': must be a JSON Schema \\(an object, or true / false\\)"),
    (dict(response_format="json_object", json_suffix=3), "json_suffix=3: must be a string"),
])
def test_sampling_values_of_the_wrong_type_are_named(kwargs, words):
    with pytest.raises(InvalidParameterError, match=words):
        SamplingParams(**kwargs).validate()


def test_sampling_params_from_a_dict():
    assert as_sampling_params({"max_tokens": 3, "temperature": 0}) == SamplingParams(max_tokens=3, temperature=0)
    assert as_sampling_params(None) == SamplingParams()
    with pytest.raises(InvalidParameterError, match=r"unknown sampling parameter\(s\) \['max_new_tokens'\]"):
        as_sampling_params({"max_new_tokens": 3})
    with pytest.raises(InvalidParameterError, match="params must be a SamplingParams or a dict of its fields; got str"):
        as_sampling_params("greedy")


def output(gen):
    for _ in gen:  # a Generation runs as it is iterated
        pass
    return gen.token_ids


@pytest.mark.real_model
def test_engine_arguments_are_checked(smollm2):
    engine = Engine(smollm2)
    ids = smollm2.encode("The capital of France is")
    greedy = SamplingParams(temperature=0, max_tokens=3)
    want = output(engine.generate(ids, greedy))
    assert len(want) == 3
    assert output(engine.generate(np.array(ids), {"temperature": 0, "max_tokens": 3})) == want
    assert output(engine.generate(torch.tensor(ids), greedy)) == want
    with pytest.raises(InvalidParameterError, match="prompt is str, not token ids"):
        engine.generate("The capital of France is", greedy)
    with pytest.raises(InvalidParameterError, match=r"prompts\[1\] is str"):
        engine.generate_batch([ids, "text"], greedy)
    with pytest.raises(InvalidParameterError, match=r"prompts\[0\] must be a list of token ids; got int"):
        engine.generate_batch(ids, greedy)  # a flat list: one prompt, not a list of them
    with pytest.raises(InvalidParameterError, match="prompts must be a list of prompts"):
        engine.generate_batch("text", greedy)
    with pytest.raises(InvalidParameterError, match="max_running=0: must be an integer >= 1"):
        Engine(smollm2, EngineConfig(max_running=0))  # it waited forever for room to admit a request
    class OnlyPrepares:  # a hook from before publish() was part of the protocol
        def prepare(self, prompt_ids, runner): ...
        def commit(self, handle, token_ids, cache): ...
    with pytest.raises(TypeError, match=r"a OnlyPrepares lacks publish; a prefix-cache hook has prepare\("):
        Engine(smollm2, prefix_cache=OnlyPrepares())
    with pytest.raises(TypeError, match="lacks prepare, publish, commit"):
        engine.prefix_cache = object()
    assert engine.prefix_cache is None  # the refused hook was not set
    for name in ("max_running", "prefill_budget", "kv_budget_tokens"):
        with pytest.raises(InvalidParameterError, match=f"{name} must be an integer >= 1, got 0"):
            BatchScheduler(engine, **{name: 0})
    assert [g.token_ids for g in engine.generate_batch([ids], [{"temperature": 0, "max_tokens": 3}])] == [want]
    with pytest.raises(InvalidParameterError, match=r"token ids must be in \[0, 49152\); got \[49152\]"):
        smollm2.runner.prefill([1, 49152], smollm2.runner.new_cache())


@pytest.mark.real_model
def test_model_text_helpers_are_checked(smollm2):
    with pytest.raises(InvalidParameterError, match="encode\\(\\) takes text \\(a str\\); got list"):
        smollm2.encode([1, 2])
    with pytest.raises(InvalidParameterError, match=r"decode\(\) ids must be in \[0, 49152\) .*got \[-1\]"):
        smollm2.decode([5, -1])
    with pytest.raises(InvalidParameterError, match=r"decode\(\) ids must be in \[0, 49152\)"):
        smollm2.decode([10**9])
    assert smollm2.decode(np.array(smollm2.encode("Paris"))) == "Paris"
    for messages in ("hello", [["user", "hi"]], [{"content": "hi"}], None):
        with pytest.raises(InvalidParameterError, match="messages must be a list of dicts, each with a 'role'"):
            smollm2.render(messages)
    with pytest.raises(InvalidParameterError, match="tools must be a list of tool dicts"):
        smollm2.render([{"role": "user", "content": "hi"}], tools={"name": "x"})
    with pytest.raises(InvalidParameterError, match="the chat template could not render these messages: "
                                                    "UndefinedError: .*'content'"):
        smollm2.render([{"role": "user"}])
    assert smollm2.render(({"role": "user", "content": "hi"},)).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("kwargs,words", [
    (dict(prefill_chunk=0), "prefill_chunk=0: must be an integer >= 1"),
    (dict(prefix_block=0), "prefix_block=0: must be an integer >= 1"),
    (dict(cache_bytes="1G"), "cache_bytes='1G': must be an integer >= 0 or None"),
    (dict(kv_bytes=0), "kv_bytes=0: must be an integer >= 1 or None"),
    (dict(kv_store_bytes=0), "kv_store_bytes=0: must be an integer >= 1 or None"),
    (dict(kv_store="/s", enable_prefix_cache=False), "kv_store='/s': .* with enable_prefix_cache on"),
    (dict(fast_decode="on"), "no setting fast_decode any more: every device runs ModelRunner.run; "
                             "EngineConfig.forward picks its path"),
    (dict(static_max_tokens=8), "no setting static_max_tokens any more: a request's KV is bounded by kv_bytes"),
    (dict(weights="int8"), "weights='int8': must be one of dense, int4"),
    (dict(forward="ops"), "forward='ops': must be one of auto, reference, cpu-ops"),
    (dict(enable_prefix_cache="no"), "enable_prefix_cache='no': must be true or false"),
    (dict(skill_repair="magic"), "unknown repair strategy 'magic'"),
    (dict(skill_preamble="long"), "unknown skill preamble 'long'"),
])
def test_engine_settings_are_named(kwargs, words):
    from kvtool.config import EngineConfig

    with pytest.raises(InvalidParameterError, match=words):
        EngineConfig(**kwargs).validate()


@pytest.mark.real_model
def test_an_engine_checks_its_settings_when_built(smollm2):
    from kvtool.config import EngineConfig

    with pytest.raises(InvalidParameterError, match="prefill_chunk=0"):
        Engine(smollm2, EngineConfig(prefill_chunk=0))  # it failed at the first prefill, as a runner 'chunk'
