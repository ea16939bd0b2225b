"""Real-world schemas (a JSONSchemaBench sample, tests/data/jsonschemabench): how many the engine compiles, against
llguidance's own strict compiler, and that every one SmolLM2 writes to the end validates (jsonschema): every third
schema of the sample (every subset keeps a third of its schemas), so the suite stays short."""

import json
from collections import Counter
from pathlib import Path

import jsonschema
import pytest
from llguidance import LLMatcher

from kvtool import SamplingParams
from kvtool.errors import InvalidParameterError

DATA = Path(__file__).parent / "data" / "jsonschemabench"
SCHEMAS = sorted(DATA.rglob("*.json"))


def compiled(schema) -> bool:
    try:
        SamplingParams(response_format="json_schema", json_schema=schema).validate()
        return True
    except InvalidParameterError:
        return False


def test_the_sample_spreads_over_every_subset():
    per = Counter(p.parent.name for p in SCHEMAS)
    assert len(SCHEMAS) >= 200 and len(per) == 10 and min(per.values()) >= 8, per


def test_coverage_is_at_least_llguidances_own():
    ours, theirs, refusals = 0, 0, Counter()
    for path in SCHEMAS:
        schema = json.loads(path.read_text())
        theirs += not LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(schema))
        try:
            SamplingParams(response_format="json_schema", json_schema=schema).validate()
            ours += 1
        except InvalidParameterError as exc:
            assert "cannot be enforced" in str(exc) or "is false" in str(exc), exc
            refusals[str(exc).split("cannot be enforced: ")[-1][:40]] += 1
    print(f"compiled {ours}/{len(SCHEMAS)}, llguidance strict {theirs}; refusals {dict(refusals)}")
    assert ours >= theirs and ours >= 0.85 * len(SCHEMAS)


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
