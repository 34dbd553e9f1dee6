"""Black-box leak probe for OpenAI-compatible inference servers (`isoserve probe`).

It attacks a running server as a researcher with API keys would, and judges whose data each
answer was computed from. See docs/probe.md; the parts: canaries.py (victim prompts and the
scan), http.py (the only contact with the server), runner.py (the run), oracles.py (what
counts as a finding), report.py (table and JSON), arguments.py (options), main.py (exit status).
"""

# What `--scenario` chooses among (runner.py runs them), and the default: all.
SCENARIOS = ("limit", "pools", "abort", "mixed")
