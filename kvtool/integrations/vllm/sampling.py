"""kvtool's SamplingParams -> vLLM's, and vLLM's logprobs -> kvtool's (top lists, prompt logprob rows).

vLLM ends a request on the same tokens kvtool's engine would (end of turn unless ignore_eos, plus
stop_token_ids) and on the stop strings; kvtool's OutputText still makes the text, so stop-string
trimming, include_stop_str_in_output and min_tokens read the same on both engines.

Structured output goes to vLLM's llguidance backend (`guidance`, which kvtool's vLLM engine defaults to:
kvtool.integrations.vllm.settings). A JSON schema goes as the grammar kvtool's own engine compiles
(kvtool.structured.grammar.json_compiled's Lark text): the schema with kvtool's compile options (compact JSON;
with strict, all of it or nothing, else lenient, the same keywords left out and reported), then any suffix (a
forced tool call's closing `\n</tool_call>`), with each special token of the model in it (Qwen2.5's
`</tool_call>`) as that one token, so the output is held to what kvtool reports on either engine.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvtool.config import SamplingParams
from kvtool.engine.scoring import PromptLogprob
from kvtool.structured.grammar import json_compiled


def to_vllm(params: SamplingParams, max_tokens: int, stops: set[int], specials: Mapping[str, int] | None = None):
    """specials: the model's added tokens, text -> id (a suffix names them as tokens)."""
    from vllm import SamplingParams as VllmParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    structured = None
    if params.choice is not None:
        structured = StructuredOutputsParams(choice=list(params.choice))
    elif params.regex is not None:
        structured = StructuredOutputsParams(regex=params.regex)
    elif params.grammar is not None:
        structured = StructuredOutputsParams(grammar=params.grammar)
    elif params.response_format == "json_schema":
        structured = StructuredOutputsParams(grammar=json_compiled(params.json_schema, params.json_suffix,
                                                                   specials or {}, params.strict).lark)
    elif params.response_format == "json_object":
        structured = StructuredOutputsParams(json_object=True)
    return VllmParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
        repetition_penalty=params.repetition_penalty, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, seed=params.seed, max_tokens=max_tokens,
        min_tokens=params.min_tokens, stop=list(params.stop) or None, stop_token_ids=sorted(stops),
        ignore_eos=params.ignore_eos, logprobs=params.logprobs, prompt_logprobs=params.prompt_logprobs,
        logit_bias=dict(params.logit_bias) or None, allowed_token_ids=params.allowed_token_ids,
        structured_outputs=structured, detokenize=bool(params.stop), skip_special_tokens=False,
        output_kind=RequestOutputKind.DELTA)


def top_list(entry: dict | None, k: int | None) -> list[tuple[int, float]]:
    """The k most likely (id, logprob) of one position's vLLM logprobs {id: Logprob(logprob, rank, ...)}."""
    if not entry or not k:
        return []
    ranked = sorted((lp.rank, tid, lp.logprob) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= k)
    return [(tid, logprob) for _, tid, logprob in ranked[:k]]


def prompt_rows(prompt_ids: list[int], rows: list | None, k: int) -> list[PromptLogprob] | None:
    """vLLM's prompt_logprobs (None first, then {id: Logprob} per position) as kvtool's PromptLogprob rows."""
    if rows is None:
        return None
    out = []
    for tid, entry in zip(prompt_ids, rows):
        own = entry.get(tid) if entry else None
        out.append(PromptLogprob(tid, None if own is None else own.logprob, None if own is None else own.rank,
                                 top_list(entry, k)))
    return out
