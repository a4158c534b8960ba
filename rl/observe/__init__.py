"""Observing a run: what each step logs, the run's typed record, and the HTML report that reads both.

    names.py          the metric-name scheme (`<group>/<stat>/<domain>`, MoE's indexed names), built and read here only
    record.py         the run record RUN_DIR/run.json: domains, env ids, families, planned steps
    telemetry.py      per-domain rollout / train-inference gap / PPO-ratio metrics and the step-time split
    moe.py            per-domain MoE telemetry (expert load, MaxVio, router entropy, aux / z, replay mismatch, MI)
    sink.py           where metrics go: metrics.jsonl, samples.jsonl, wandb; the progress-bar text
    wandb_layout.py   what wandb gets at many domains: roll-up series, every domain's values in a table
    report_data.py    `load_run`: a run directory as one typed `RunData`
    svg.py            inline-SVG chart primitives
    report_domains.py the report's per-family / per-domain sections for hundreds of domains
    report.py         `jointrl report RUN_DIR`: the self-contained HTML page

The driver (rl/train.py) and the trainer call the producers; nothing here runs episodes, trains or
decides sampling weights (the sampler reads typed rollout groups and the run record's families).
"""
