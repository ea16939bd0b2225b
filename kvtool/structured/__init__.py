"""Structured output: what a constrained output may be, as pure-Python character automata (no torch).

JSON syntax (json_syntax), JSON mode (json_mode), a JSON schema narrowing it (json_schema, with $ref/anyOf in
schema_refs and value bounds, patterns and formats in schema_values), a regular expression (regex_mode) and a
fixed list of choices (choice). The engine wraps them around its sampler; config checks a request's schema and
pattern with the same code, so a bad one is refused before any model runs.
"""
