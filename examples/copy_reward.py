"""The copy task's reward, in TRL's reward-function signature (batched lists in, one
score per completion out), so the same file would work with ``trl``'s GRPOTrainer.

Each digit of ``answer`` the completion has at its position earns an equal share; a
completion in chat form is a list of messages, whose last content is the text.
"""


def copy_reward(prompts, completions, completion_ids, answer, **kwargs):
    scores = []
    for completion, want in zip(completions, answer, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        right = sum(1 for i, d in enumerate(want) if i < len(text) and text[i] == d)
        scores.append(right / len(want))
    return scores
