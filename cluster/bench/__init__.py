"""``baton bench``: load generation and measurement against OpenAI-compatible servers.

Modules: ``workload`` (lengths, shared prefixes, traces), ``prompts`` (exact-length prompts from
the served tokenizer), ``arrivals`` (Poisson/gamma schedules), ``client`` (one timed stream),
``runner`` (open/closed loop, warm-up, cold start), ``metrics`` (summary, SLOs, goodput),
``report`` (JSON, Markdown, PNG), ``sweep`` (load sweep and knee), ``cli_args`` (the command),
``fakeserver`` (a server with injected delays, for testing the measurement).
"""
