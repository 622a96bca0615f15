"""Every public option has a test that shows a non-default value taking effect.

An option is a parameter with a default, of the scheduler, the objective, the sources,
``fit`` and ``dew train``'s rewards. ``EFFECT_TESTS`` names, for each, the test that
sets it to something else and checks what must then differ (a validation test alone
does not count: an option can be checked and then ignored). A new option fails
``test_every_option_names_its_effect_test`` until its test is listed here.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from dew.core import ThreadedSource
from dew.gateway import HarnessSource
from dew.job.rewards import combine, load_reward
from dew.objectives.rl import GRPOObjective, RolloutScheduler
from dew.objectives.rl.sources import EnvironmentSource, PromptSource
from dew.recipe import Recipe
from dew.train import fit

TESTS = Path(__file__).parent

SCHEDULER = "objectives/rl/test_scheduler.py"
GRPO = "objectives/rl/test_grpo.py"
KNOBS = f"{GRPO}::test_each_knob_of_the_objective_changes_its_loss_as_the_formula_says"
KL = f"{GRPO}::test_kl_to_a_reference_adds_its_term_and_pulls_toward_it"
ENV = "objectives/rl/sources/test_environment_source.py"
PROMPTS = "objectives/rl/sources/test_prompt_source.py"
HARNESS = "gateway/test_harness.py"
CWD = f"{HARNESS}::test_cwd_sets_the_subprocess_directory_and_max_output_bytes_keeps_the_tail"
FIT = "train/test_fit.py"
FAULTS = "job/test_reward_pool.py::test_each_way_a_reward_can_fail_is_that_calls_error_naming_it"

EFFECT_TESTS: dict[Callable[..., Any], dict[str, str]] = {
    RolloutScheduler: {
        "tasks": f"{SCHEDULER}::test_tasks_turns_each_batch_into_the_sources_tasks",
        "groups": "objectives/rl/test_scheduler_config.py::test_non_default_knobs_take_effect",
        "oversample": f"{SCHEDULER}::test_oversample_admits_first_finishers_and_cancels_rest",
        "admit": f"{SCHEDULER}::test_admit_takes_first_groups_and_cancels_others",
        "max_lag": f"{SCHEDULER}::test_stale_finished_rollout_is_discarded_and_resubmitted",
        "ahead": f"{SCHEDULER}::test_ahead_submits_next_batches_under_served_version",
        "sync_every": f"{SCHEDULER}::test_pushes_first_call_sync_every_and_after_reopen",
        "max_attempts": f"{SCHEDULER}::test_max_attempts_abandons_group_rest_still_trains",
        "timeout": f"{SCHEDULER}::test_timeout_cancels_and_resubmits_as_failed_attempt",
        "estimator": f"{SCHEDULER}::test_the_estimator_sets_the_packed_advantages",
        "truncation": f"{SCHEDULER}::test_score_truncation_without_reward_is_unscored",
        "support_capacity": (
            f"{SCHEDULER}::test_support_capacity_packs_the_support_of_filtered_sampling"
        ),
        "log": f"{SCHEDULER}::test_record_fields",
    },
    GRPOObjective: {
        "clip": KNOBS,
        "clip_high": KNOBS,
        "importance_cap": KNOBS,
        "importance": (
            f"{GRPO}::test_importance_mask_drops_the_tokens_outside_the_band_from_the_objectives_loss"
        ),
        "temperature": KNOBS,
        "kl_coef": KL,
        "reference": KL,
        "clip_behavior": (
            f"{GRPO}::test_clip_behavior_stops_the_tokens_that_moved_past_the_band_since_sampling"
        ),
        "proximal": (
            "objectives/rl/test_grpo_proximal.py::"
            "test_a_scheduler_over_a_forward_objective_makes_no_rescoring_forward"
        ),
    },
    ThreadedSource: {
        "workers": "objectives/rl/test_sessions.py::test_pool_is_bounded_by_workers",
        "stuck_after": (
            "objectives/rl/test_stuck_source.py::"
            "test_threaded_source_lists_rollouts_running_past_their_cancel"
        ),
    },
    EnvironmentSource: {
        "wall_clock": f"{ENV}::test_wall_clock_limit",
        "workers": f"{ENV}::test_workers_bounds_how_many_episodes_run_at_once",
    },
    PromptSource: {
        "tokenizer": f"{PROMPTS}::test_text_prompts_and_chat_template",
        "chat_template": f"{PROMPTS}::test_text_prompts_and_chat_template",
        "workers": (
            f"{PROMPTS}::test_submit_path_generates_everything_while_the_only_worker_verifies"
        ),
        "column": f"{PROMPTS}::test_dataset_column_prompts",
        "group_size": (
            "objectives/rl/sources/test_group_verifier.py::"
            "test_with_a_group_size_late_starters_join_and_oversampled_ones_are_not_waited_for"
        ),
    },
    HarnessSource: {
        "tasks": f"{HARNESS}::test_tasks_hands_the_harness_and_verifier_the_full_task",
        "workers": f"{HARNESS}::test_workers_bounds_how_many_harnesses_run_at_once",
        "grace": f"{HARNESS}::test_cancel_terminates_the_subprocess_then_kills_it",
        "timeout": f"{HARNESS}::test_wall_clock_timeout_stops_the_harness",
        "env": f"{HARNESS}::test_subprocess_environment",
        "cwd": CWD,
        "max_output_bytes": CWD,
        "processes": (
            "gateway/test_harness_processes.py::"
            "test_runs_go_to_the_processes_and_come_back_recorded"
        ),
    },
    load_reward: {
        "weight": "job/test_rewards.py::test_trl_and_dew_signatures_combine_with_weights",
        "timeout": FAULTS,
    },
    combine: {"pool": FAULTS},
    fit: {
        "run_dir": f"{FIT}::test_a_failed_write_leaves_the_previous_checkpoint_whole",
        "checkpoint_every": f"{FIT}::test_resume_reproduces_an_uninterrupted_run_bit_for_bit",
        "keep": f"{FIT}::test_keep_sets_how_many_checkpoints_stay",
        "prefetch": f"{FIT}::test_prefetch_deeper_than_ahead_reads_that_far_ahead",
        "resume": f"{FIT}::test_resume_reproduces_an_uninterrupted_run_bit_for_bit",
        "log": f"{FIT}::test_fit_writes_records_and_a_final_checkpoint",
        "max_grad_norm": f"{FIT}::test_max_grad_norm_bounds_the_step_and_none_leaves_it_whole",
        "tensorboard": (
            f"{FIT}::test_tensorboard_false_writes_no_events_and_config_reaches_the_checkpoint"
        ),
        "config": (
            f"{FIT}::test_tensorboard_false_writes_no_events_and_config_reaches_the_checkpoint"
        ),
        "freeze_gc": (
            f"{FIT}::test_fit_freezes_the_heap_after_ten_steps_when_asked_and_unfreezes_it"
        ),
        "micro_batches": f"{FIT}::test_micro_batches_give_the_whole_batchs_update",
        "pool": "pool/test_pool.py::test_two_processes_shard_the_model_and_match_one_process",
        "max_empty_steps": f"{FIT}::test_steps_that_train_nothing_warn_once_then_stop_the_run",
    },
    Recipe: {
        name: "test_recipe.py::test_each_recipe_option_takes_effect"
        for name in (
            "objective",
            "reference",
            "weight_decay",
            "seed",
            "data_seed",
            "device",
            "parallel",
            "wrap",
        )
    },
}


def options(owner: Callable[..., Any]) -> set[str]:
    """The parameters of ``owner`` that have a default: what a user may leave out."""
    params = inspect.signature(owner).parameters.values()
    return {p.name for p in params if p.default is not inspect.Parameter.empty}


@cache
def functions_of(path: str) -> dict[str, str]:
    """Each test function of ``path`` (under tests/), with its decorators, by name."""
    text = (TESTS / path).read_text()
    lines = text.splitlines()
    out = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            out[node.name] = "\n".join(lines[first - 1 : node.end_lineno])
    return out


def _name(owner: Callable[..., Any]) -> str:
    return owner.__qualname__


@pytest.mark.parametrize("owner", list(EFFECT_TESTS), ids=_name)
def test_every_option_names_its_effect_test(owner: Callable[..., Any]) -> None:
    listed = set(EFFECT_TESTS[owner])
    assert options(owner) - listed == set(), f"{_name(owner)}: options without an effect test"
    assert listed - options(owner) == set(), f"{_name(owner)}: listed, but not options"


@pytest.mark.parametrize(
    ("owner", "option"),
    [(owner, option) for owner, tests in EFFECT_TESTS.items() for option in tests],
    ids=lambda v: v if isinstance(v, str) else _name(v),
)
def test_each_effect_test_exists_and_sets_its_option(
    owner: Callable[..., Any], option: str
) -> None:
    path, name = EFFECT_TESTS[owner][option].split("::")
    found = functions_of(path)
    assert name in found, f"{path} has no test {name}"
    # The test must name the option: a renamed or rewritten test that no longer sets
    # it is caught here rather than left pointing at something else.
    assert option in found[name], (path, name, option)
