"""The judge: a model reads each attempt's trajectory after the fact and answers a rubric about it.

rubric.py: the questions (a TOML file, or the default); prompt.py: the trajectory and rubric as a prompt, and the
model's answer parsed (an unparseable one is a recorded parse failure); shim.py: the shim as a child process, under
the judge's own key and budget; runner.py: the pass over a run, one verdict row per (attempt, rubric), idempotent
and resumable. `python -m dispatcher judge RUN [--rubric FILE]`.
"""
