"""The course kit, beside the engine: what the chapters measure and draw, never imported by it.

    bench/         the measuring kit: workloads, timing, machine facts, load generator, peers,
                   roofline, profiling, the tour
    plots/         every picture of the course, one module per topic
    text.py        demo prompts and how to show a continuation
    exercises.py   the exercise registry and the student copy
    commands.py    the `minivllm` subcommands of the course (tour, bench-serve, exercises)

The ladder of chapters 1-6 is minivllm/stages/ (its STAGES is a public contract).
"""
