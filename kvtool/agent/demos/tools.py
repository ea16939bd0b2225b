"""Real, safe tools for demos and evaluation: no network, no shell, no writes outside
a workspace. Slow tools take a `scale` so tests can run the same scenario fast."""

from __future__ import annotations

import asyncio
from datetime import datetime
from pathlib import Path
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from kvtool.agent.demos.calculator import calculate
from kvtool.agent.retry import ToolInputError
from kvtool.agent.tools import Tier, Tool, ToolContext

# a local stand-in for a weather service: deterministic, so evaluations can check answers
WEATHER = {
    "paris": (14, "light rain"), "tokyo": (22, "sunny"), "london": (11, "overcast"),
    "new york": (18, "partly cloudy"), "berlin": (9, "windy"), "sydney": (25, "clear"),
    "san francisco": (16, "fog"), "madrid": (27, "sunny"), "rome": (21, "clear"),
    "toronto": (6, "snow showers"), "mumbai": (31, "humid, thunderstorms"), "cairo": (33, "hot and dry"),
}
MAX_FILE_CHARS = 200_000


def _obj(props: dict, required: list[str]) -> dict:
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def get_time(timezone: str = "UTC") -> str:
    try:
        now = datetime.now(ZoneInfo(timezone))
    except (ZoneInfoNotFoundError, ValueError):
        raise ToolInputError(f"unknown time zone {timezone!r}; use an IANA name like 'Asia/Tokyo'") from None
    return f"{now:%Y-%m-%d %H:%M:%S} {now.tzname()} ({timezone}, UTC{now:%z})"


def make_demo_tools(workspace: str | Path = ".", scale: float = 1.0, weather_latency_s: float = 1.0) -> list[Tool]:
    root = Path(workspace).resolve()

    async def get_weather(city: str) -> str:
        await asyncio.sleep(weather_latency_s * scale)  # what a weather API round trip feels like
        key = city.strip().lower()
        if key not in WEATHER:
            raise ToolInputError(f"no weather data for {city!r}; known cities: {', '.join(c.title() for c in WEATHER)}")
        temp, sky = WEATHER[key]
        return f"{city.strip().title()}: {temp} °C, {sky}"

    def resolve(path: str) -> Path:
        target = (root / path).resolve()  # resolve() follows symlinks, so links cannot escape either
        if target != root and root not in target.parents:
            raise ToolInputError(f"{path!r} is outside the workspace {root}; use a path relative to it")
        return target

    def read_file(path: str) -> str:
        target = resolve(path)
        if not target.is_file():
            raise ToolInputError(f"no file {path!r} in the workspace (use list_files to see what exists)")
        return target.read_text(encoding="utf-8", errors="replace")[:MAX_FILE_CHARS]

    def list_files(path: str = ".") -> str:
        target = resolve(path)
        if not target.is_dir():
            raise ToolInputError(f"{path!r} is not a folder in the workspace")
        entries = sorted(p.relative_to(root).as_posix() + ("/" if p.is_dir() else "") for p in target.iterdir())
        return "\n".join(entries) or "(empty folder)"

    async def long_task(seconds: float, label: str = "task", ctx: ToolContext | None = None) -> str:
        steps = 10
        for i in range(steps):
            await asyncio.sleep(seconds * scale / steps)
            if ctx:
                ctx.progress((i + 1) / steps, f"{label}: step {i + 1}/{steps}")
        return f"{label} finished after {seconds:g} s"

    def phone_call(company: str, message: str = "") -> str:
        return f"simulated call to {company}: nobody answered (message not delivered)"

    seconds = {"type": "number", "minimum": 0, "maximum": 3600}
    return [
        Tool("get_time", "Current date and time in an IANA time zone.",
             _obj({"timezone": {"type": "string", "description": "IANA name, e.g. Europe/Paris"}}, []), get_time),
        Tool("get_weather", "Current weather for a city (local table).",
             _obj({"city": {"type": "string"}}, ["city"]), get_weather, timeout_s=10 + 5 * scale),
        Tool("calculator", "Evaluate an arithmetic expression (+ - * / // % **, sqrt, log, sin, ...).",
             _obj({"expression": {"type": "string"}}, ["expression"]), calculate),
        Tool("read_file", "Read a text file from the workspace folder.",
             _obj({"path": {"type": "string", "description": "relative to the workspace"}}, ["path"]), read_file),
        Tool("list_files", "List a folder of the workspace.",
             _obj({"path": {"type": "string"}}, []), list_files),
        Tool("long_task", "Run a slow job in the foreground (simulated build/test run) and wait for it.",
             _obj({"seconds": seconds, "label": {"type": "string"}}, ["seconds"]), long_task,
             timeout_s=3600 * scale + 5),
        Tool("start_job", "Start a slow job in the background; returns a task id at once.",
             _obj({"seconds": seconds, "label": {"type": "string"}}, ["seconds"]), long_task,
             timeout_s=3600 * scale + 5, background=True),
        Tool("phone_call", "Call a company's support line (simulated; nobody is really called).",
             _obj({"company": {"type": "string"}, "message": {"type": "string"}}, ["company"]), phone_call,
             tier=Tier.WRITE, target_arg="company", max_calls_per_target=3),
    ]
