"""What shows the agent off and measures it, built on the core loop in kvtool.agent.

    scenarios      the scripted scenarios of `kvtool agent --demo NAME` (DEMOS)
    runner         run_demo: a registered demo against a live endpoint or its own script
    tools          make_demo_tools: real, safe tools (weather, time, files, calculator)
    calculator     arithmetic without eval(): a whitelist walk over the Python AST
    script         scripted model replies in the OpenAI chunk format
    scripted       ScriptedBackend: replays a script in process
    fake_endpoint  FakeEndpoint: replays a script over real HTTP on 127.0.0.1
    eval_cases     fixed tool-using prompts and the call a correct answer makes
    evaluate       tool-use and status-bar cache evaluation against any OpenAI-compatible endpoint
"""
