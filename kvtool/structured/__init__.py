"""Structured output: a request's JSON schema, regex, choices or Lark/GBNF grammar as one llguidance grammar.

kvtool.structured.grammar maps the request fields to llguidance and checks that the grammar compiles (text
only, no torch), so config refuses a schema or grammar the engine could not enforce before any model runs;
kvtool.engine.constraint holds the per-request matcher and masks the logits with it.
"""
