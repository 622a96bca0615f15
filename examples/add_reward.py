"""The addition task's reward, in TRL's reward-function signature: what a newcomer
writes first. Each digit of the sum at its position earns an equal share, so a model
that gets a sum partly right learns from it."""


def add_reward(prompts, completions, completion_ids, answer, **kwargs):
    scores = []
    for text, want in zip(completions, answer, strict=True):
        right = sum(1 for i, d in enumerate(want) if i < len(text) and text[i] == d)
        scores.append(right / len(want))
    return scores
