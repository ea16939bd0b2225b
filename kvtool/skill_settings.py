"""The settings of a skill setup, checked without a model: the preamble spec and each repair strategy's knobs.

EngineConfig.validate() checks `skill_preamble` and `skill_repair` here, so a bad spec is refused before any
model loads; kvtool.skills.preamble compiles blocks after the preamble, and each strategy in
kvtool.skills.repair is its knob class below plus how it places a block.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvtool.errors import InvalidParameterError

# ---- the preamble a block is compiled after (kvtool.skills.preamble) -------------------------------------

DEEP_TOKENS = 2048
NAMES = ("conversation", "none", "deep")


def parse_preamble(spec: str) -> tuple[str, int]:
    """'conversation' | 'none' | 'deep' | 'deep:tokens=N' -> (name, tokens); tokens is 0 but for deep."""
    name, _, rest = str(spec).partition(":")
    if name not in NAMES:
        raise InvalidParameterError(f"unknown skill preamble {spec!r}; use one of conversation, none, deep, "
                                    "deep:tokens=N")
    if name != "deep":
        if rest:
            raise InvalidParameterError(f"skill preamble {name!r} takes no knobs, got {spec!r}")
        return name, 0
    if not rest:
        return name, DEEP_TOKENS
    key, _, value = rest.partition("=")
    if key != "tokens" or not value.isdigit() or int(value) < 1:
        raise InvalidParameterError(f"skill preamble {spec!r}: the knob is tokens=N with N >= 1 (deep:tokens=2048)")
    return name, int(value)


def canonical_preamble(spec: str) -> str:
    """The spelling a setup key and a block's metadata record ('deep' and 'deep:tokens=2048' are one)."""
    name, tokens = parse_preamble(spec)
    return f"deep:tokens={tokens}" if name == "deep" else name


# ---- repair strategies' knobs (kvtool.skills.repair adds how each places a block) ------------------------

DEVIATION_SCORES = ("kv", "kv_rel", "v")  # how recompute_deviation scores a token (kvtool.skills.selective.SCORES)
ATTENDED_SCORES = ("attention_v", "attention")  # probability times the value's norm, or the probability alone


@dataclass
class NoRepairKnobs:
    name = "none"
    knob = None


@dataclass
class RecomputeFirstKKnobs:
    k: int = 16
    name = "recompute_first_k"
    knob = "k"

    def __post_init__(self):
        if not isinstance(self.k, int) or self.k < 0:
            raise InvalidParameterError(f"recompute_first_k: k must be an integer >= 0, got {self.k!r}")


@dataclass
class RecomputeDeviationKnobs:
    ratio: float = 0.1
    layer: int = 1
    score: str = "kv"
    first: int = 0
    name = "recompute_deviation"
    knob = "ratio"

    def __post_init__(self):
        if self.score not in DEVIATION_SCORES:
            raise InvalidParameterError(f"recompute_deviation: score must be one of {', '.join(DEVIATION_SCORES)}, "
                                        f"got {self.score!r}")
        if not isinstance(self.first, int) or self.first < 0:
            raise InvalidParameterError(f"recompute_deviation: first must be an integer >= 0, got {self.first!r}")
        if not (isinstance(self.ratio, (int, float)) and 0.0 <= self.ratio <= 1.0):
            raise InvalidParameterError(f"recompute_deviation: ratio must be in [0, 1], got {self.ratio!r}")
        if not isinstance(self.layer, int) or self.layer < 1:
            raise InvalidParameterError(f"recompute_deviation: layer must be an integer >= 1 (layer 0 KV does "
                                        f"not depend on context), got {self.layer!r}")


@dataclass
class RecomputeAttendedKnobs:
    ratio: float = 0.1
    window: int = 64
    score: str = "attention_v"
    name = "recompute_attended"
    knob = "ratio"
    query_guided = True  # compose_segments hands it the token run after the blocks (repair_run)

    def __post_init__(self):
        if not (isinstance(self.ratio, (int, float)) and 0.0 <= self.ratio <= 1.0):
            raise InvalidParameterError(f"recompute_attended: ratio must be in [0, 1], got {self.ratio!r}")
        if not isinstance(self.window, int) or self.window < 1:
            raise InvalidParameterError(f"recompute_attended: window must be an integer >= 1, got {self.window!r}")
        if self.score not in ATTENDED_SCORES:
            raise InvalidParameterError(f"recompute_attended: score must be one of {', '.join(ATTENDED_SCORES)}, "
                                        f"got {self.score!r}")


REPAIR_KNOBS: dict[str, type] = {cls.name: cls for cls in (NoRepairKnobs, RecomputeFirstKKnobs,
                                                           RecomputeDeviationKnobs, RecomputeAttendedKnobs)}


def parse_repair(spec="none", registry: dict[str, type] = REPAIR_KNOBS, **knobs):
    """A repair from an instance, a name plus knobs, or a CLI string 'name' / 'name:knob=value,knob=value':
    the instance itself, or registry[name](**knobs), each knob checked (kvtool.skills.repair.make_repair passes
    its strategies as the registry)."""
    if not isinstance(spec, str):
        if not hasattr(spec, "place"):
            raise InvalidParameterError(f"repair must be a strategy name ({', '.join(registry)}) or a repair "
                                        f"object; got {type(spec).__name__}")
        return spec
    name, _, rest = spec.partition(":")
    if name not in registry:
        raise InvalidParameterError(f"unknown repair strategy {name!r}; use one of {', '.join(registry)}")
    cls = registry[name]
    allowed = {f.name: f.type for f in fields(cls)}
    for key in knobs:
        if key not in allowed:
            raise InvalidParameterError(f"repair {name!r} has no knob {key!r}; knobs: {', '.join(allowed) or 'none'}")
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in allowed:
            raise InvalidParameterError(f"repair {name!r} has no knob {key!r}; knobs: {', '.join(allowed) or 'none'}")
        try:
            cast = {"int": int, "float": float}.get(allowed[key] if isinstance(allowed[key], str) else
                                                    allowed[key].__name__, str)
            knobs[key] = cast(value)
        except ValueError:
            raise InvalidParameterError(f"repair knob {key}={value!r} is not a number") from None
    return cls(**knobs)
