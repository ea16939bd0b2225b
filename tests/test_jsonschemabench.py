"""Real-world schemas (a JSONSchemaBench sample, tests/data/jsonschemabench): how many the engine compiles with
strict (against llguidance's own strict compiler) and without (every one: what it cannot enforce is left out and
named), that each strict refusal names its keyword and the lenient compile lists it, and on SmolLM2 that every
answer written to the end validates: every third schema of the sample (every subset keeps a third of its
schemas) against the whole schema, and every schema with a keyword left out against the schema without it."""

import json
import re
from collections import Counter
from pathlib import Path

import jsonschema
import pytest
from llguidance import LLMatcher

from kvtool import SamplingParams
from kvtool.errors import InvalidParameterError
from kvtool.structured.lenient import parses
from kvtool.structured import schema as tree

DATA = Path(__file__).parent / "data" / "jsonschemabench"
SCHEMAS = sorted(DATA.rglob("*.json"))


def compiled(schema) -> bool:
    try:
        SamplingParams(response_format="json_schema", json_schema=schema, strict=True).validate()
        return True
    except InvalidParameterError:
        return False


def relaxed(node, names: set[str], named: bool = False):
    """node as the grammar enforces it without strict: the keywords named (unenforced) left out, a oneOf an anyOf,
    a pattern llguidance cannot parse dropped."""
    if isinstance(node, list):
        return [relaxed(v, names) for v in node]
    if not isinstance(node, dict):
        return node
    if named:
        return {k: relaxed(v, names) for k, v in node.items()}
    out = {}
    for k, v in node.items():
        if k in tree.DATA:
            out[k] = v
        elif k == "pattern" and isinstance(v, str) and not parses(v) or k in names and k not in ("oneOf", "pattern"):
            continue
        elif k != "oneOf" or k not in names:
            out[k] = relaxed(v, names, k in tree.NAMED)
    if "oneOf" in names and isinstance(node.get("oneOf"), list):  # beside an anyOf of its own: both must hold
        out["allOf"] = out.get("allOf", []) + [{"anyOf": relaxed(node["oneOf"], names)}]
    return out


def test_the_sample_spreads_over_every_subset():
    per = Counter(p.parent.name for p in SCHEMAS)
    assert len(SCHEMAS) >= 200 and len(per) == 10 and min(per.values()) >= 8, per


def test_coverage_is_at_least_llguidances_own():
    ours, theirs, refusals = 0, 0, Counter()
    for path in SCHEMAS:
        schema = json.loads(path.read_text())
        theirs += not LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(schema))
        try:
            SamplingParams(response_format="json_schema", json_schema=schema, strict=True).validate()
            ours += 1
        except InvalidParameterError as exc:
            assert "cannot be enforced" in str(exc) or "is false" in str(exc), exc
            named = re.search(r" uses (\S+), which|\.(pattern) is a regex", str(exc))
            refusals[(named.group(1) or named.group(2)) if named else str(exc)[-60:]] += 1
    print(f"compiled {ours}/{len(SCHEMAS)}, llguidance strict {theirs}; refusals {dict(refusals)}")
    assert ours >= theirs and ours >= 0.85 * len(SCHEMAS)


def test_without_strict_every_schema_compiles_and_what_strict_refuses_is_named():
    lenient, listed = 0, Counter()
    for path in SCHEMAS:
        schema = json.loads(path.read_text())
        params = SamplingParams(response_format="json_schema", json_schema=schema).validate()
        lenient += 1
        unenforced = {u.keyword: u.paths for u in params.unenforced}
        listed.update(unenforced.keys())
        assert all(paths for paths in unenforced.values()), (path, unenforced)
        try:
            SamplingParams(response_format="json_schema", json_schema=schema, strict=True).validate()
            assert not unenforced, (path, unenforced)  # strict takes it whole: nothing was left out
        except InvalidParameterError as exc:  # refused by keyword and where: the lenient compile names it
            named = re.search(r"enforced: (\S+?)(?: uses (\S+), which|\.pattern is a regex)", str(exc))
            assert named, exc
            keyword = named.group(2) or "pattern"
            assert keyword in unenforced and named.group(1) in unenforced[keyword], (path, exc, unenforced)
    print(f"without strict: compiled {lenient}/{len(SCHEMAS)}; unenforced keywords {dict(listed)}")
    assert lenient == len(SCHEMAS)


@pytest.mark.real_model
def test_every_schema_smollm2_writes_to_the_end_validates(smollm2):
    from kvtool.engine import Engine

    engine = Engine(smollm2)
    schemas = [s for s in (json.loads(p.read_text()) for p in SCHEMAS[::3]) if compiled(s)]
    prompts, params = [], []
    for schema in schemas:
        text = json.dumps(schema)[:400]  # a glimpse: the grammar does the rest
        prompts.append(smollm2.encode_chat([{"role": "user", "content": "Write one short JSON "
                                                    f"instance of this schema:\n{text}"}]))
        params.append(SamplingParams(temperature=0, max_tokens=48, response_format="json_schema", json_schema=schema))
    gens = engine.generate_batch(prompts, params)  # EngineConfig.max_running: 16 at once
    finished = Counter(g.finish_reason for g in gens)
    for schema, gen in zip(schemas, gens):
        if gen.finish_reason == "stop":
            jsonschema.validate(json.loads(gen.text), schema)
    print(f"{len(schemas)} schemas: {dict(finished)}")
    assert set(finished) <= {"stop", "length"} and finished["stop"] >= 10  # the rest were cut by max_tokens


@pytest.mark.real_model
def test_without_strict_what_is_enforced_holds_on_smollm2(smollm2):
    """Every schema with a keyword left out: SmolLM2's finished answers validate against the schema without it."""
    from kvtool import EngineConfig
    from kvtool.engine import Engine

    engine = Engine(smollm2, EngineConfig(max_running=32))  # every case in one batch
    cases = []
    for path in SCHEMAS:
        schema = json.loads(path.read_text())
        params = SamplingParams(temperature=0, max_tokens=96, response_format="json_schema",
                                json_schema=schema).validate()
        if params.unenforced:
            cases.append((path, schema, params))
    prompts = [smollm2.encode_chat([{"role": "user", "content": "Write one short JSON instance of this "
                                         f"schema:\n{json.dumps(schema)[:400]}"}]) for _, schema, _ in cases]
    gens = engine.generate_batch(prompts, [params for *_, params in cases])
    finished, whole = 0, 0
    for (path, schema, params), gen in zip(cases, gens):
        assert gen.finish_reason in ("stop", "length"), (path, gen.finish_reason)
        if gen.finish_reason != "stop":
            continue
        value = json.loads(gen.text)
        jsonschema.validate(value, relaxed(schema, {u.keyword for u in params.unenforced}))
        finished += 1
        whole += jsonschema.validators.validator_for(schema)(schema).is_valid(value)
    print(f"{len(cases)} schemas with keywords left out: {finished} finished, all valid without them; "
          f"{whole} valid against the whole schema")
    assert len(cases) >= 20 and finished >= 5  # the rest were cut by max_tokens
