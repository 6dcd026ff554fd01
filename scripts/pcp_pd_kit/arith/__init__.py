"""The trained demo model: templated GSM8K-format arithmetic, a seeded training recipe, the build.

problems (the generator and the held-out split) -> train (the loop) -> build (cached like the
random tiny model, plus the held-out task's JSONL for lm-eval).
"""
