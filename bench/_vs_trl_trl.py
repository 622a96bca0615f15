"""The TRL side of bench/vs_trl.py: ``trl.GRPOTrainer`` on the demo's tasks, timed.

Every setting comes from the same ``DemoConfig`` as the dew side (see ``grpo_config``
for each field and why). The model is ``make_model`` with the run's seed, so both
systems start from identical weights; prompts are the demo's digit strings, tokenized
by the same char tokenizer to the same ids (checked); the reward function calls the
demo's own verifier (``DigitTask.verifier``) on TRL's completion ids, which, like dew's,
end with the stop token when the model stopped.

Heavy-tailed tasks (``dew.demo.tail``): the single-turn one through a reward function
that runs the task's verifier (and so its drawn latency) over the batch on a thread pool,
the multi-turn one through ``rollout_func`` as below, each episode with its own number
of turns (a turn's generation covers only the episodes still going).

Two-turn task: GRPOTrainer has two ways to run more than one model turn. Tools and
``environment_factory`` continue a conversation only when the model writes a tool call
that the tokenizer's response schema parses; this environment answers every reply, so
that path cannot express it. ``rollout_func`` (experimental in TRL 1.16) hands the whole
generation to the caller; ``_episodes_rollout`` drives the conversation with TRL's own
generation call (``GRPOTrainer._generate_single_turn``, one batched ``model.generate``
per turn), steps the environments concurrently (so a turn costs one ``latency``, not one
per episode), and marks the environment's tokens with ``env_mask`` = 0 so they carry no
loss. The token streams are built by dew's ``ChatTokens``, as dew's EnvironmentSource
builds them, so both systems train on the same conversations.

Idle time: TRL generates and scores on its training thread
(``_generate_and_score_completions``), so that method's time per step is the time the
trainer does not train; ``run_trl`` wraps it to measure that.

Threads: the environment and verifier thread pool is owned by ``run_trl`` and shut down (joined) on
the way out; TRL itself runs on the calling thread.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from _vs_trl_common import (
    TURNS,
    RunResult,
    RunSpec,
    StepClock,
    TwoTurnCopyEnv,
    demo_config,
    make_two_turn,
)


def grpo_config(spec: RunSpec, config: Any, output_dir: str) -> Any:
    """GRPOConfig matching the dew run's settings; each field says why it is set."""
    from trl import GRPOConfig

    rows = config.batch_size * config.group_size
    return GRPOConfig(
        output_dir=output_dir,  # a temporary folder; nothing is saved into it
        # the same optimizer: AdamW (torch), constant lr, no weight decay, grad norm 1
        learning_rate=config.lr,
        optim="adamw_torch",
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,  # torch.optim.AdamW's defaults, which dew's run uses
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,  # dew.train.fit's default
        # one update per generated batch of batch_size prompts x group_size samples
        num_generations=config.group_size,
        per_device_train_batch_size=rows,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        max_steps=spec.max_steps,
        seed=spec.seed,
        shuffle_dataset=True,
        # sampling: the demo's temperature, no top-k / top-p (dew's server: None)
        max_completion_length=config.max_tokens,  # per turn on the two-turn task
        temperature=config.temperature,
        top_k=0,
        top_p=1.0,
        # the loss: no KL, PPO clip [1 - 0.2, 1 + clip_high] (dew's clip default and
        # the demo's clip-higher), advantages scaled by the group's std (dew's group_std),
        # a constant normalizer (dew divides by rows x width; dr_grpo by rows x
        # max_completion_length) and truncated completions scored, not masked (the
        # demo's truncation="score")
        beta=0.0,
        epsilon=0.2,
        epsilon_high=config.clip_high,
        scale_rewards="group",
        loss_type="dr_grpo",
        mask_truncated_completions=False,
        # CPU, fp32, plain model.generate, no activation checkpointing (dew uses none)
        use_cpu=True,
        bf16=False,
        fp16=False,
        use_vllm=False,
        activation_checkpointing=False,
        # a log record per step (the clock reads the step's mean reward from it), no
        # checkpoints, no trackers, no progress bar
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        remove_unused_columns=False,  # the reward function reads the task index column
        dataloader_num_workers=0,
    )


def _copy_reward(config: Any, tokenizer: Any) -> tuple[Callable[..., list[float]], list[str]]:
    """(reward function over TRL's completion ids, the prompt texts) for the copy task."""
    from dew.core import Call, Task
    from dew.demo.tasks import make_task

    low, high = config.digits
    task = make_task(
        config.tasks,
        seed=config.seed,
        tokenizer=tokenizer,
        min_digits=low,
        max_digits=high,
        stop_weight=config.stop_weight,
    )
    texts = [t + "=" for t in task.texts]
    for i, text in enumerate(texts):  # TRL tokenizes the text; it must give dew's prompt ids
        ids = [int(t) for t in tokenizer(text)["input_ids"]]
        if ids != task.prompts[i]:
            raise RuntimeError(f"task {i}: TRL would see {ids}, dew sees {task.prompts[i]}")

    def copy_reward(
        prompts: list[str], completions: list[str], completion_ids: list[list[int]], **kwargs: Any
    ) -> list[float]:
        out = []
        for index, ids, text in zip(kwargs["task_index"], completion_ids, completions, strict=True):
            i = int(index)
            call = Call(
                prompt=task.prompts[i], completion=ids, log_probs=[0.0] * len(ids), version=0
            )
            out.append(float(sum(task.verifier(Task(id=str(i)), text, call).values())))
        return out

    return copy_reward, texts


def env_reward(prompts: list[str], completions: list[Any], **kwargs: Any) -> list[float]:
    """The two-turn environment's score, handed over by the rollout function."""
    return [float(r) for r in kwargs["env_score"]]


def _tail_reward(task: Any, pool: ThreadPoolExecutor) -> Callable[..., list[float]]:
    """The heavy-tailed task's reward function: its verifier (which sleeps a drawn
    latency) over the batch's completions at once on ``pool``, so a batch waits for its
    slowest verification, not for the sum of them (what a TRL user with a slow sandbox
    would write)."""
    from dew.core import Call, Task

    def one(index: Any, ids: list[int]) -> float:
        i = int(index)
        call = Call(prompt=task.prompts[i], completion=ids, log_probs=[0.0] * len(ids), version=0)
        return float(sum(task.verifier(Task(id=str(i)), "", call).values()))

    def tail_reward(
        prompts: list[str], completions: list[str], completion_ids: list[list[int]], **kwargs: Any
    ) -> list[float]:
        return list(pool.map(one, kwargs["task_index"], completion_ids))

    return tail_reward


def _episodes_rollout(
    make_env: Callable[[], Any], tokenizer: Any, max_turns: int, pool: ThreadPoolExecutor
) -> Callable[[list[str], Any], dict[str, Any]]:
    """A ``rollout_func`` over environments (each prompt is a task id): every turn one
    batched generation for the episodes still going, their environments stepped at once
    on ``pool``; returns TRL's rollout fields."""
    from dew.core import Task
    from dew.objectives.rl.sources import ChatTokens

    chat = ChatTokens(tokenizer)
    eos = int(tokenizer.eos_token_id)

    def rollout(prompts: list[str], trainer: Any) -> dict[str, Any]:
        envs = [make_env() for _ in prompts]
        first = [
            chat.first([{"role": "user", "content": env.reset(Task(id=str(p)))}])
            for env, p in zip(envs, prompts, strict=True)
        ]
        context = [list(ids) for ids in first]  # what the model sees next, per episode
        completion: list[list[int]] = [[] for _ in prompts]  # model and environment tokens
        env_mask: list[list[int]] = [[] for _ in prompts]  # 1 = the model's token
        live = list(range(len(prompts)))  # episodes the environment has not ended
        for _ in range(max_turns):
            if not live:
                break
            replies, _ = trainer._generate_single_turn([context[i] for i in live], None, {}, 1)
            replies = [[int(t) for t in r] for r in replies]
            stopped = [bool(r) and r[-1] == eos for r in replies]
            texts = [
                tokenizer.decode(r[:-1] if s else r, skip_special_tokens=False)
                for r, s in zip(replies, stopped, strict=True)
            ]
            observations = list(pool.map(lambda i, t: envs[i].step(t), live, texts))
            going = []
            for i, reply, done, obs in zip(live, replies, stopped, observations, strict=True):
                completion[i] += reply
                env_mask[i] += [1] * len(reply)
                if obs is None:
                    continue
                said = tokenizer.decode(reply, skip_special_tokens=False)
                extra = chat.after_reply(said, done, [{"role": "user", "content": obs}])
                completion[i] += extra
                env_mask[i] += [0] * len(extra)
                context[i] += reply + extra
                going.append(i)
            live = going
        scores = [float(sum(env.score().values())) for env in envs]
        # logprobs: TRL reads the sampler's log-probs only with vLLM; its own generate
        # path reports none either
        return {
            "prompt_ids": first,
            "completion_ids": completion,
            "logprobs": None,
            "env_mask": env_mask,
            "env_score": scores,
        }

    return rollout


def run_trl(spec: RunSpec) -> RunResult:
    import datasets
    import torch
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOTrainer

    from dew.demo.model import make_model, make_tokenizer
    from dew.demo.tail import make_tail_task

    config = demo_config(spec)
    rows = config.batch_size * config.group_size
    result = RunResult(spec=spec, rows=rows)
    clock = StepClock(spec, result)

    generating = [0.0]  # seconds in generation and scoring since the last step

    class Clock(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.start()

        def on_log(
            self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any
        ) -> None:
            if logs and "reward" in logs:
                idle, generating[0] = generating[0], 0.0
                if clock.step(logs["reward"], idle):
                    control.should_training_stop = True

    torch.manual_seed(config.seed)
    tokenizer = make_tokenizer()
    tokenizer.padding_side = "left"  # GRPOTrainer's documented requirement
    model = make_model(config.arch, config.size, seed=config.seed, max_positions=config.positions)
    with tempfile.TemporaryDirectory() as out, ThreadPoolExecutor(max_workers=rows) as pool:
        if spec.task == "single":
            reward, texts = _copy_reward(config, tokenizer)
            data = {"prompt": texts, "task_index": list(range(len(texts)))}
            extra: dict[str, Any] = {}
        elif spec.task == "tail":
            tail = make_tail_task(config.tasks, seed=config.seed, tokenizer=tokenizer)
            reward = _tail_reward(tail, pool)
            texts = [t + "=" for t in tail.texts]
            data = {"prompt": texts, "task_index": list(range(len(texts)))}
            extra = {}
        else:
            if spec.task == "multi":
                task = make_two_turn(config.tasks, seed=config.seed, tokenizer=tokenizer)
                make_env, turns = partial(TwoTurnCopyEnv, task, latency=spec.latency), TURNS
            else:
                tail = make_tail_task(config.tasks, seed=config.seed, tokenizer=tokenizer)
                make_env, turns = tail.env, tail.workload.max_turns
            reward = env_reward
            data = {"prompt": [str(i) for i in range(config.tasks)]}
            extra = {"rollout_func": _episodes_rollout(make_env, tokenizer, turns, pool)}
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=grpo_config(spec, config, out),
            train_dataset=datasets.Dataset.from_dict(data),
            processing_class=tokenizer,
            callbacks=[Clock()],
            **extra,
        )
        trainer.remove_callback(PrinterCallback)  # disable_tqdm's per-step printout
        # The trainer's idle time: TRL generates and scores on the training thread, in
        # this method, between optimizer steps.
        generate = trainer._generate_and_score_completions

        def timed_generate(*args: Any, **kwargs: Any) -> Any:
            t0 = time.monotonic()
            try:
                return generate(*args, **kwargs)
            finally:
                generating[0] += time.monotonic() - t0

        trainer._generate_and_score_completions = timed_generate
        trainer.train()
    return result
