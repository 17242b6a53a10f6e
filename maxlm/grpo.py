"""``python -m maxlm.grpo --config=grpo_tiny.gin``: RL from verifiable rewards (GRPO) through the shared loop.

The same command line as ``python -m maxlm.train`` (resume, --fresh, --run_dir, gin bindings),
for configs with TrainConfig.task = "grpo"; see maxlm/data/prompts.py for the prompts and
maxlm/posttrain/grpo.py for the rollouts, the advantages, the loss and the metrics.
"""

import sys

EPILOG = """examples:
  python -m maxlm.sft --config=sft_tiny.gin --run_dir=runs/sft_upper_250 --gin_bindings="TrainConfig.steps=250"
  python -m maxlm.grpo --config=grpo_tiny.gin                      # from runs/sft_upper_250
  python -m maxlm.grpo --config=grpo_tiny.gin --gin_bindings="GRPOConfig.prompts='data/math/*.jsonl'"
  python -m maxlm.grpo --config=grpo_tiny.gin --gin_bindings="GRPOConfig.reward='python:my_rewards:score'"
  python -m maxlm.grpo --config=grpo_tiny.gin --gin_bindings="GRPOConfig.reward='model:runs/reward_tiny'"

GRPOConfig.prompts: JSONL lines {"prompt": a string or chat messages, "answer": a string}, or
synthetic:upper|reverse|sort|capitalize[:N]. Bad lines are counted and listed with FILE:LINE, never
fatal. Each step samples GRPOConfig.group_size completions of TrainConfig.global_batch / group_size
prompts from the current policy, scores them (GRPOConfig.reward: exact | contains | similarity |
python:MODULE:FUNCTION, called as f(reply, answer) -> float | model:RUN_DIR, a reward model trained
with python -m maxlm.reward), and trains on group-relative advantages with a clipped objective
(clip_range) and a KL penalty (kl_coef) to the run's frozen start. Logged: reward, reward_std, kl,
clip_fraction, completion_length; each evaluation logs eval/reward (greedy replies to held-out
prompts). Rerunning with the same --run_dir resumes, sampling the same completions."""


def main(argv=None) -> int:
    if argv is None:
        from maxlm.train import allocator
        allocator.use_huge_pages()  # before jax is imported: the process may re-execute itself
    from maxlm.posttrain import build_task
    from maxlm.train.pretrain import main as train_main

    return train_main(argv, build_task=build_task, name="maxlm.grpo", task="grpo", epilog=EPILOG,
                      default_config="grpo_tiny.gin", description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
