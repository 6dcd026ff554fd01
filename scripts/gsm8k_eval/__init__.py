"""Helpers behind scripts/eval_gsm8k.sh: expected scores, the offline task, scoring, manifest.

The shell script runs lm-eval; everything that decides something (which score to expect, whether
a run passed, what the manifest says) lives here as small functions that tests can call directly.
"""
