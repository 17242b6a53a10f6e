"""``python -m maxlm.reward --config=reward_tiny.gin``: a reward model through the shared loop.

The same command line as ``python -m maxlm.train`` (resume, --fresh, --run_dir, gin bindings),
for configs with TrainConfig.task = "reward"; see maxlm/data/preference.py for the data and
maxlm/posttrain/reward.py for the head, the loss and the metrics.
"""

import sys

EPILOG = """examples:
  python -m maxlm.sft --config=sft_tiny.gin --run_dir=runs/sft_upper_250 --gin_bindings="TrainConfig.steps=250"
  python -m maxlm.reward --config=reward_tiny.gin                  # from runs/sft_upper_250
  python -m maxlm.reward --config=reward_tiny.gin --gin_bindings="RewardConfig.data='data/prefs/*.jsonl'"
  python -m maxlm.reward --config=reward_tiny.gin --gin_bindings="ModelConfig.lora_rank=8"

RewardConfig.data: JSONL lines {"prompt", "chosen", "rejected"}, each a string or a list of chat
messages, or synthetic:TASK[:N[:KINDS]] (TASK upper|reverse|sort|capitalize or a mixture a+b;
KINDS of wrong reply unchanged+reversed+substituted+dropped+other). Bad lines are counted and
listed with FILE:LINE, never fatal. The reward of a conversation is a scalar head on the final hidden state of
its last reply token; the loss is -log sigmoid(r_chosen - r_rejected) (+ center_rewards_coefficient
(r_chosen + r_rejected)^2). Logged: accuracy, margin, rewards/chosen, rewards/rejected (means over
pairs). python -m maxlm.hf export RUN --out DIR writes the head as DIR/reward_head.safetensors.
Rerunning with the same --run_dir resumes."""


def main(argv=None) -> int:
    if argv is None:
        from maxlm.train import allocator
        allocator.use_huge_pages()  # before jax is imported: the process may re-execute itself
    from maxlm.posttrain import build_task
    from maxlm.train.pretrain import main as train_main

    return train_main(argv, build_task=build_task, name="maxlm.reward", task="reward", epilog=EPILOG,
                      default_config="reward_tiny.gin", description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
