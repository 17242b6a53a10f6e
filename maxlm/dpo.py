"""``python -m maxlm.dpo --config=dpo_tiny.gin``: Direct Preference Optimization through the shared loop.

The same command line as ``python -m maxlm.train`` (resume, --fresh, --run_dir, gin bindings),
for configs with TrainConfig.task = "dpo"; see maxlm/data/preference.py for the data and
maxlm/posttrain/dpo.py for the loss, the reference and the metrics.
"""

import sys

EPILOG = """examples:
  python -m maxlm.sft --config=sft_tiny.gin --run_dir=runs/sft_upper_250 --gin_bindings="TrainConfig.steps=250"
  python -m maxlm.dpo --config=dpo_tiny.gin                       # from runs/sft_upper_250
  python -m maxlm.dpo --config=dpo_tiny.gin --gin_bindings="DPOConfig.data='data/prefs/*.jsonl'"
  python -m maxlm.dpo --config=dpo_tiny.gin --gin_bindings="DPOConfig.loss_type='ipo'"
  python -m maxlm.dpo --config=dpo_tiny.gin --gin_bindings="ModelConfig.lora_rank=8"   # reference = the base

DPOConfig.data: JSONL lines {"prompt", "chosen", "rejected"}, each a string or a list of chat messages
({"role", "content"}), or synthetic:TASK[:N[:KINDS]] (TASK upper|reverse|sort|capitalize or a mixture
a+b; the right answer chosen, a wrong one of KINDS unchanged+reversed+substituted+dropped+other
rejected). Bad lines are counted and listed with FILE:LINE, never fatal. loss_type sigmoid (DPO,
label_smoothing for cDPO), robust or ipo, beta the KL strength, as TRL defines them. The reference is
the run's start (TrainConfig.init_from / init_params), frozen; with LoRA it is the base without the
adapters. Logged: rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen,
logps/rejected (means over pairs). Rerunning with the same --run_dir resumes."""


def main(argv=None) -> int:
    if argv is None:
        from maxlm.train import allocator
        allocator.use_huge_pages()  # before jax is imported: the process may re-execute itself
    from maxlm.posttrain import build_task
    from maxlm.train.pretrain import main as train_main

    return train_main(argv, build_task=build_task, name="maxlm.dpo", task="dpo", epilog=EPILOG,
                      default_config="dpo_tiny.gin", description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
