"""JSON mode and JSON schema mode on llguidance: the mask on SmolLM2's vocabulary, SmolLM2 answering alone,
batched, seeded and with logprobs and stop strings, and which schemas are refused (by the keyword) or taken."""

import dataclasses
import json

import jsonschema
import pytest
import torch

from kvtool import SamplingParams
from kvtool.errors import InvalidParameterError

CAT = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
       "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.parametrize("schema,keyword", [
    ({"type": "array", "uniqueItems": True}, "uniqueItems"), ({"dependencies": {"a": ["b"]}}, "dependencies"),
    ({"not": {"type": "string"}}, "not"), ({"type": "object", "properties": {"a": {"minLength": "x"}}}, "minLength"),
    ({"oneOf": [{"type": "object"}, {"type": "object", "required": ["a"]}]}, "oneOf")])
def test_a_schema_the_engine_cannot_enforce_is_refused_naming_the_keyword(schema, keyword):
    with pytest.raises(InvalidParameterError, match=f"json_schema.*{keyword}"):
        SamplingParams(response_format="json_schema", json_schema=schema, strict=True).validate()


@pytest.mark.parametrize("schema,unenforced", [
    ({"type": "array", "uniqueItems": True}, {"uniqueItems": ("schema",)}),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "dependencies": {"a": ["b"]}},
     {"dependencies": ("schema",)}),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}, "b": {"type": "array", "uniqueItems": True}}},
     {"not": ("schema.properties.a",), "uniqueItems": ("schema.properties.b",)}),
    ({"oneOf": [{"type": "object"}, {"type": "object", "required": ["a"]}]}, {"oneOf": ("schema",)}),
    ({"type": "string", "pattern": "^(?!x)[a-z]+$"}, {"pattern": ("schema",)}),  # look-around: llguidance cannot
    ({"type": "object", "properties": {"a": {"type": "string"}}, "minProperties": 1}, {"minProperties": ("schema",)}),
    ({"type": "object", "properties": {"uniqueItems": {"type": "string", "format": "no-such-format"}}}, {}),
    ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, {})])  # alternatives that cannot both match: enforced
def test_without_strict_the_rest_is_enforced_and_what_is_not_named_with_where(schema, unenforced):
    params = SamplingParams(response_format="json_schema", json_schema=schema).validate()
    assert {u.keyword: u.paths for u in params.unenforced} == unenforced
    assert SamplingParams(response_format="json_schema", json_schema=schema, strict=True).unenforced == ()
    if unenforced:
        with pytest.raises(InvalidParameterError, match=f"{next(iter(unenforced))}.*without strict, the rest"):
            SamplingParams(response_format="json_schema", json_schema=schema, strict=True).validate()


def test_strict_is_the_requests_flag_and_a_bad_schema_is_refused_either_way():
    with pytest.raises(InvalidParameterError, match="strict=1: must be true or false"):
        SamplingParams(response_format="json_schema", json_schema={"type": "object"}, strict=1).validate()
    for strict in (True, False):
        with pytest.raises(InvalidParameterError, match="points to nothing"):
            SamplingParams(response_format="json_schema", json_schema={"$ref": "#/$defs/x"}, strict=strict).validate()
        with pytest.raises(InvalidParameterError, match="schema uses uniqueItems"):  # the schema's x-guidance: no say
            SamplingParams(response_format="json_schema", strict=True, json_suffix="\n" * strict, json_schema={
                "type": "array", "uniqueItems": True, "x-guidance": {"lenient": True}}).validate()
        with pytest.raises(InvalidParameterError, match=r"schema.properties.a.minLength is invalid"):
            SamplingParams(response_format="json_schema", strict=strict,
                           json_schema={"type": "object", "properties": {"a": {"minLength": "x"}}}).validate()


@pytest.mark.parametrize("schema", [
    {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}},  # patternProperties
    {"type": "array", "items": {"type": "string"}}, {"type": "string", "pattern": "^[a-z]+$"}, True,  # non-object roots
    {"type": "object", "properties": {"$ref": {"type": "string"}}, "required": ["$ref"]},  # a property named $ref
    {"$defs": {"n": {"type": "integer", "required": ["a"], "additionalProperties": False}},
     "type": "object", "properties": {"n": {"$ref": "#/$defs/n"}}},  # object keywords on an integer: ignored
    {"type": "integer", "multipleOf": 7}, {"type": "object", "properties": {"u": {"format": "uri-reference"}}}])
def test_schemas_the_old_automata_refused_compile(schema):
    SamplingParams(response_format="json_schema", json_schema=schema).validate()


@pytest.mark.real_model
def test_the_mask_allows_exactly_what_continues_the_grammar(smollm2):
    from kvtool.engine import Engine

    engine = Engine(smollm2)
    stops = engine.stop_ids(SamplingParams())
    c = engine.constraint(SamplingParams(choice=["positive", "negative"]).validate(), stops)
    tok = smollm2.tokenizer
    ok = c.allowed(torch.device("cpu"))
    allowed = ok.nonzero().flatten().tolist()
    pieces = [tok.decode([t]) for t in allowed]
    assert allowed and all(("positive".startswith(p) or "negative".startswith(p)) and p for p in pieces), pieces
    assert not ok[sorted(stops)].any()  # not a whole choice yet: the turn may not end
    for t in tok.encode("negative", add_special_tokens=False):
        c.accept(t)
    ok = c.allowed(torch.device("cpu"))
    assert set(ok.nonzero().flatten().tolist()) == stops  # a whole choice, and no longer one: only the end
    c = engine.constraint(SamplingParams(response_format="json_schema", json_schema={
        "type": "object", "properties": {"colour": {"const": "blue"}}, "required": ["colour"]}).validate(), stops)
    forced = []
    while (t := c.forced()) is not None:  # every byte is fixed: the matcher names each token
        forced.append(t)
        assert c.allowed(torch.device("cpu")).nonzero().flatten().tolist() == [t]
        c.accept(t)
    text = tok.decode(forced)  # up to where a token could still join the next bytes in another way
    assert '{"colour": "blue"}'.startswith(text) and len(text) >= len('{"colour": "blue'), text
    with pytest.raises(InvalidParameterError, match="doesn.t satisfy the grammar"):
        engine.constraint(SamplingParams(choice=["yes"]).validate(), stops).accept(tok.encode("no")[0])



@pytest.mark.real_model
def test_masks_filled_together_equal_each_requests_own(smollm2):
    """allowed_rows (the batched sampler's masks, filled by llguidance's thread pool in one call) gives every row
    what that request's own Constraint allows, step by step, with rows forced, free, ended and mid-schema."""
    from kvtool.engine import Engine
    from kvtool.engine.constraint import allowed_rows

    engine = Engine(smollm2)
    stops = engine.stop_ids(SamplingParams())
    cpu = torch.device("cpu")
    params = [SamplingParams(response_format="json_schema", json_schema=CAT), SamplingParams(response_format=
              "json_object"), SamplingParams(choice=["positive", "negative"]), SamplingParams(regex=r"[0-9]{2,4}")]
    pair = [[engine.constraint(p.validate(), stops) for p in params] for _ in range(2)]
    texts = ['{"name": "Tom", "age": 3}', '{"a": [1, 2]}', "negative", "2024"]
    walks = [smollm2.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    for step in range(max(map(len, walks)) + 1):
        together = allowed_rows(pair[0], cpu)
        for i, c in enumerate(pair[1]):
            assert torch.equal(together[i], c.allowed(cpu)), (i, step)
        for batch in pair:
            for c, walk in zip(batch, walks):
                if step < len(walk):
                    c.accept(walk[step])
    assert all(set(row.nonzero().flatten().tolist()) <= stops for row in allowed_rows(pair[0], cpu)[2:])

@pytest.mark.real_model
def test_smollm2_answers_in_the_schema_alone_batched_seeded_with_logprobs_and_stop_strings(smollm2):
    from kvtool.engine import Engine

    engine = Engine(smollm2)
    prompt = smollm2.encode_chat(
        [{"role": "user", "content": "Describe a cat as JSON with fields name and age."}])
    free = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=48)).run()
    with pytest.raises(json.JSONDecodeError):
        json.loads(free.text)  # left alone, it fences the object in Markdown and talks on
    greedy = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=48, response_format="json_object")).run()
    assert greedy.finish_reason == "stop" and isinstance(json.loads(greedy.text), dict)
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=40, response_format="json_schema", json_schema=CAT,
                            logprobs=2)
    sampled = engine.generate_batch([prompt, prompt], [params, dataclasses.replace(params, seed=None)], n=2)
    again = engine.generate(prompt, dataclasses.replace(params, seed=4)).run()
    assert sampled[1].token_ids == again.token_ids  # seeded: drawn alone, as its own seeded run (seed 3 + 1)
    for gen in sampled:  # the unseeded pair is drawn by the batched sampler, each row under its own mask
        assert gen.finish_reason == "stop", gen.text
        jsonschema.validate(json.loads(gen.text), CAT)
    cut = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=4, response_format="json_schema",
                                                 json_schema=CAT)).run()
    assert cut.finish_reason == "length" and cut.text.startswith('{"')
    stopped = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=48, stop=['"age"'],
                                                     response_format="json_schema", json_schema=CAT)).run()
    assert stopped.finish_reason == "stop" and stopped.text.startswith('{"name": ') and '"age"' not in stopped.text


@pytest.mark.real_model
def test_a_suffix_follows_the_value_before_the_turn_ends(smollm2):
    from kvtool.engine import Engine

    engine = Engine(smollm2)
    prompt = smollm2.encode_chat([{"role": "user", "content": "Call the weather tool for Paris."}])
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    gen = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=40, response_format="json_schema",
                                                 json_schema=schema, json_suffix="\n</tool_call>")).run()
    assert gen.finish_reason == "stop" and gen.text.endswith("}\n</tool_call>"), gen.text
    jsonschema.validate(json.loads(gen.text[: -len("\n</tool_call>")]), schema)


def test_a_special_token_in_the_suffix_is_that_token_and_plain_text_stays_text():
    from kvtool.structured.grammar import suffix_lark

    assert suffix_lark("\n</tool_call>", {"</tool_call>": 151658, "<tool_call>": 151657}) == '"\\n" <[151658]>'
    assert suffix_lark("\n</tool_call>", {"<|im_end|>": 2}) == '"\\n</tool_call>"'


@pytest.mark.real_model
def test_qwen_closes_a_call_with_its_special_token_and_spells_special_text_in_plain_tokens(qwen25):
    from kvtool.engine import Engine

    engine = Engine(qwen25)
    close = qwen25.tokenizer.convert_tokens_to_ids("</tool_call>")
    prompt = qwen25.encode_chat([{"role": "user", "content": "Call the weather tool for Paris."}])
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    gen = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=40, response_format="json_schema",
                                                 json_schema=schema, json_suffix="\n</tool_call>")).run()
    assert gen.finish_reason == "stop" and gen.token_ids[-2] == close, gen.token_ids  # the tag as Qwen2.5 writes it
    jsonschema.validate(json.loads(gen.text.removesuffix("\n</tool_call>")), schema)
    # a JSON string and a regex that spell the tag's text: written in plain tokens, never the refused special one
    tagged = {"type": "object", "properties": {"tag": {"const": "</tool_call>"}}, "required": ["tag"],
              "additionalProperties": False}
    for params in (SamplingParams(temperature=0, max_tokens=40, response_format="json_schema", json_schema=tagged),
                   SamplingParams(temperature=0, max_tokens=40, regex=r'<tool_call>\n\{"city": "Paris"\}')):
        gen = engine.generate(prompt, params).run()
        assert gen.finish_reason == "stop" and close not in gen.token_ids, gen.token_ids
        assert gen.text in ('{"tag": "</tool_call>"}', '<tool_call>\n{"city": "Paris"}'), gen.text


def test_a_suffix_with_a_special_token_compiles_leniently_as_without():
    """A forced call's closing tag as the model's token (`<[id]>`) is checked without a tokenizer here: llguidance's
    warning about it is no keyword left out."""
    from kvtool.structured.grammar import json_compiled

    schema = {"type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}}
    for suffix, specials in (("", {}), ("\n</tool_call>", {"</tool_call>": 151658})):
        compiled = json_compiled(schema, suffix, specials, strict=False)
        assert [(u.keyword, u.paths) for u in compiled.unenforced] == [("uniqueItems", ("schema.properties.t",))]
        assert ("<[151658]>" in compiled.lark) == bool(specials)
