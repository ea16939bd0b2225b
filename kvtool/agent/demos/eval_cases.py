"""A fixed set of tool-using prompts with the call a correct answer must make.

Checks are on meaning, not spelling: city names case-insensitively, time zones as IANA
names, arithmetic by evaluating the expression the model wrote.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from kvtool.agent.demos.calculator import calculate
from kvtool.agent.retry import ToolInputError

Check = Callable[[dict[str, Any]], bool]


@dataclass(frozen=True)
class EvalCase:
    prompt: str
    tool: str
    check: Check
    expect: str  # what the check wants, for reports


def city(name: str) -> tuple[Check, str]:
    return (lambda a: str(a.get("city", "")).strip().lower() == name.lower()), f"city={name}"


def tz(name: str) -> tuple[Check, str]:
    return (lambda a: str(a.get("timezone", "")).strip() == name), f"timezone={name}"


def value(expected: float) -> tuple[Check, str]:
    def check(a: dict[str, Any]) -> bool:
        try:
            return abs(float(calculate(str(a.get("expression", "")))) - expected) < 1e-6 * max(1.0, abs(expected))
        except (ToolInputError, TypeError, ValueError):
            return False

    return check, f"expression evaluating to {expected:g}"


def path(name: str) -> tuple[Check, str]:
    return (lambda a: str(a.get("path", "")).strip().removeprefix("./") == name), f"path={name}"


def todo_items(n: int) -> tuple[Check, str]:
    return (lambda a: isinstance(a.get("items"), list) and len(a["items"]) == n), f"{n} items"


def company(name: str) -> tuple[Check, str]:
    return (lambda a: str(a.get("company", "")).strip().lower() == name.lower()), f"company={name}"


def seconds(n: float) -> tuple[Check, str]:
    return (lambda a: isinstance(a.get("seconds"), (int, float)) and abs(a["seconds"] - n) < 1e-9), f"seconds={n:g}"


def _case(prompt: str, tool: str, spec: tuple[Check, str]) -> EvalCase:
    return EvalCase(prompt, tool, spec[0], spec[1])


# files evaluate.py writes into the eval workspace, so read_file cases have something to read
WORKSPACE_FILES = {
    "notes.txt": "Meeting moved to Thursday 10:00. Bring the Q3 numbers.\n",
    "data/config.json": '{"batch_size": 8, "model": "Qwen2.5-0.5B"}\n',
    "README.md": "# Demo workspace\nA few files for the agent evaluation.\n",
}

EVAL_CASES: list[EvalCase] = [
    _case("What's the weather like in Paris right now?", "get_weather", city("Paris")),
    _case("Is it raining in London today? Check the weather.", "get_weather", city("London")),
    _case("Tell me the current weather in Tokyo.", "get_weather", city("Tokyo")),
    _case("How hot is it in Cairo at the moment?", "get_weather", city("Cairo")),
    _case("Weather report for Sydney, please.", "get_weather", city("Sydney")),
    _case("What time is it in Tokyo? Use the time zone Asia/Tokyo.", "get_time", tz("Asia/Tokyo")),
    _case("What is the current time in New York (America/New_York)?", "get_time", tz("America/New_York")),
    _case("Give me the current UTC time.", "get_time", tz("UTC")),
    _case("What's the local time in Berlin? The zone is Europe/Berlin.", "get_time", tz("Europe/Berlin")),
    _case("Use the calculator: what is 17 * 23?", "calculator", value(391)),
    _case("Compute 2 to the power of 16 with the calculator.", "calculator", value(65536)),
    _case("What is the square root of 1764? Use the calculator.", "calculator", value(42)),
    _case("Calculate (125 + 375) / 4.", "calculator", value(125)),
    _case("With the calculator, how much is 15% of 240?", "calculator", value(36)),
    _case("Read the file notes.txt and tell me when the meeting is.", "read_file", path("notes.txt")),
    _case("Open data/config.json and tell me the batch size.", "read_file", path("data/config.json")),
    _case("Show me what README.md says.", "read_file", path("README.md")),
    _case("Make a TODO list with three items: buy milk, call mom, write report.", "rewrite_todo_list",
          todo_items(3)),
    _case("Set up a TODO list with two items: fix the bug and write the tests.", "rewrite_todo_list",
          todo_items(2)),
    _case("Call Comcast support with phone_call and say my internet is down.", "phone_call", company("Comcast")),
    _case("Start a background job with start_job that runs for 5 seconds.", "start_job", seconds(5)),
    _case("Run a foreground long_task for 1 second labelled 'build'.", "long_task", seconds(1)),
]
