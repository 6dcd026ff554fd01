"""The reference the live tests hold vLLM to: transformers' own greedy decoding."""

from __future__ import annotations

from pathlib import Path


def hugging_face_greedy(
    model_path: Path, prompts: list[str], max_new_tokens: int
) -> list[tuple[str, int]]:
    """Transformers' own greedy decoding of the served model, in float32 as the stack serves it:
    (generated text, prompt tokens) per prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    answers = []
    for prompt in prompts:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        answers.append((tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True), ids.shape[1]))
    return answers
