"""`kvtool agent`: an interactive session, or `--demo NAME` scripted scenarios.

Defaults come from AgentConfig; heavy imports happen inside the handler.
"""

from __future__ import annotations

import argparse

from kvtool.agent.config import AgentConfig
from kvtool.agent.demos.scenarios import DEMOS
from kvtool.agent.status_bar import PLACEMENTS


def register(subparsers: argparse._SubParsersAction) -> None:
    d = AgentConfig()
    p = subparsers.add_parser(
        "agent",
        help="agent loop with streaming tool dispatch (interactive, or --demo NAME)",
        description="Talk to an OpenAI-compatible endpoint with tools that start while the model streams. "
        "Interactive: type a message; while the agent works, a new line is queued as an event, "
        "a line starting with '!' (or Ctrl-C) interrupts it. /status shows the status bar, /exit quits.",
    )
    p.add_argument("--endpoint", default=d.endpoint, help=f"base URL of the API (default: {d.endpoint})")
    p.add_argument("--model", default=d.model, help="model id (default: the first one the endpoint lists)")
    p.add_argument("--api-key", default=d.api_key, help="bearer token, if the endpoint needs one")
    demos = "; ".join(f"{n}: {demo.description}" for n, demo in DEMOS.items())
    p.add_argument("--demo", choices=list(DEMOS), help="run a scripted scenario: " + demos.replace("%", "%%"))
    p.add_argument("--status-bar", choices=list(PLACEMENTS), default=d.status_bar,
                   help=f"where the <agent_status> message goes (default: {d.status_bar})")
    p.add_argument("--max-iterations", type=int, default=d.max_iterations,
                   help=f"model calls per request (default: {d.max_iterations})")
    p.add_argument("--workspace", default=None, help="folder the file tools may read (default: a temp folder "
                   "for demos, the current folder for interactive sessions)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply simulated tool durations (demos)")
    p.add_argument("--scripted", action="store_true",
                   help="replay the demo's own scripted model replies instead of calling an endpoint")
    p.add_argument("--skills", default=None, metavar="DIR",
                   help="add a Skill tool that loads the skills in DIR on demand (interactive; pair with "
                        "kvtool serve --skills DIR so the loaded skills are spliced from their KV blocks)")
    p.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    import asyncio

    from kvtool.errors import KvtoolError

    if args.max_iterations < 1:
        raise KvtoolError(f"--max-iterations must be >= 1, got {args.max_iterations}")
    if args.scripted and not args.demo:
        raise KvtoolError("--scripted replays a demo's script; also pass --demo NAME")
    config = AgentConfig(endpoint=args.endpoint, model=args.model, api_key=args.api_key, status_bar=args.status_bar,
                         max_iterations=args.max_iterations, workdir=args.workspace)
    extra = []
    if args.skills:
        if args.demo:
            raise KvtoolError("--skills adds the Skill tool to the interactive session; demos bring their own tools")
        from kvtool.agent.skills import skill_tool

        tool, prompt = skill_tool(args.skills)
        extra.append(tool)
        config.system_prompt = f"{config.system_prompt}\n\n{prompt}"
    return asyncio.run(_main(args, config, extra))


async def _main(args: argparse.Namespace, config: AgentConfig, extra_tools: list | None = None) -> int:
    from kvtool.agent.demos.runner import get_demo, run_demo, scripted_backend
    from kvtool.agent.http_backend import OpenAIHTTPBackend
    from kvtool.agent.interactive import interactive_session
    from kvtool.agent.render import TerminalObserver
    from kvtool.agent.trajectory import message_problems

    if args.scripted:
        backend = scripted_backend(args.demo)
    else:
        backend = OpenAIHTTPBackend(config.endpoint, config.model, config.api_key)
        models = await backend.list_models()  # fails early, with a hint, if nothing is listening
        if not backend.model:
            if not models:
                from kvtool.errors import KvtoolError

                raise KvtoolError(f"{config.endpoint}/models lists no model; pass --model NAME")
            backend.model = models[0]
    observer = TerminalObserver()
    if not args.demo:
        return await interactive_session(backend, config, observer, workspace=args.workspace or ".",
                                         extra_tools=extra_tools)
    demo = get_demo(args.demo)
    print(f"demo {demo.name}: {demo.description}\nprompt: {demo.prompt}\n")
    result = await run_demo(demo.name, backend, config, scale=args.scale, workspace=args.workspace,
                            observer=observer)
    problems = message_problems(result.messages) + demo.check(result)
    rate = result.cache_hit_rate
    print(f"\nstop: {result.stop_reason}; model calls: {len(result.turns)}; "
          f"prefix-cache hit rate: {'n/a' if rate is None else f'{rate:.1%}'} (status bar: {config.status_bar})")
    for p in problems:
        print(f"check failed: {p}")
    return 1 if problems else 0
