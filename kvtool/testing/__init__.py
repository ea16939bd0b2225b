"""What tests import: the offline real models, tiny random checkpoints and a server in a child process (from
kvtool.models and kvtool.serving, where benchmarks use them too), the agent's weather task, op tracing."""
