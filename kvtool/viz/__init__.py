"""kvtool.viz: attention visualizer (sinks, position bias, status-bar focus) and the web inspector.

Line budget: docs/architecture.md (Python), ~350 for the static page. One concept per module; the CLI (`kvtool viz`)
calls the same functions:

    probs      reference attention inside the forward's tap (fp32, per layer, selected rows only)
    tokens     token pieces, role/channel per token, named spans      select  layer/head/row selections
    inputs     prompt / messages file / server URL -> Tokens (+ --generate)
    heatmap    compute_heatmap + plot_heatmap (block pooling for long inputs)
    sink       sink_stats, sink_table, plot_sink                       position  position_stats, plot_position
    needle     needle_experiment, plot_needle                          focus     focus, plot_focus
    static     the web inspector's page; its routes are kvtool.serving.inspect_http (`kvtool serve` at /inspect)
    config     VizConfig: every default                                plots     matplotlib Agg, PNG/SVG
"""
