"""``python -m maxlm.sft --config=sft_tiny.gin``: supervised fine-tuning through the shared loop.

The same command line as ``python -m maxlm.train`` (resume, --fresh, --run_dir, gin bindings),
for configs with TrainConfig.task = "sft"; see maxlm/data/sft.py for the data rules and
maxlm/posttrain/sft.py for the task.
"""

import sys

EPILOG = """examples:
  python -m maxlm.sft --config=sft_tiny.gin
  python -m maxlm.sft --config=sft_tiny.gin --gin_bindings="SFTConfig.data='data/chat/*.jsonl'"
  python -m maxlm.sft --config=sft_tiny.gin --gin_bindings="TrainConfig.init_from='runs/tiny'"
  python -m maxlm.sft --config=sft_tiny.gin --gin_bindings="TrainConfig.init_params='runs/imported/params'"

SFTConfig.data: JSONL lines {"instruction", "input" (optional), "output"} or {"messages": [{"role",
"content"}, ...]}, or synthetic:reverse|upper|sort[:N]. Loss is on the assistant replies only;
bad lines are counted and listed with FILE:LINE, never fatal. Start from a base with
TrainConfig.init_from (a maxlm run) or TrainConfig.init_params (python -m maxlm.hf import output).
Rerunning with the same --run_dir resumes. Ask the model with:
  python -m maxlm.generate --checkpoint RUN_DIR --chat --prompt $'Uppercase the word.\\n\\nabc'"""


def main(argv=None) -> int:
    if argv is None:
        from maxlm.train import allocator
        allocator.use_huge_pages()  # before jax is imported: the process may re-execute itself
    from maxlm.posttrain import build_task
    from maxlm.train.pretrain import main as train_main

    return train_main(argv, build_task=build_task, name="maxlm.sft", task="sft", epilog=EPILOG,
                      default_config="sft_tiny.gin", description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
