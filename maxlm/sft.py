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
  python -m maxlm.sft --config=lora_tiny.gin            # LoRA: rank-8 adapters, the base frozen

LoRA/QLoRA: ModelConfig.lora_rank (0 = off), lora_alpha, lora_dropout, lora_targets (a regex over
attn/q_proj ... mlp/down_proj, lm_head); only the adapters train. Over an INT4 base (a run made by
python -m maxlm.quantize, trained with that run's config.gin) it is QLoRA. Export merged, base-only
or as a PEFT adapter with python -m maxlm.hf export RUN --out DIR --lora merge|base|peft.

SFTConfig.data: JSONL lines {"instruction", "input" (optional), "output"} or {"messages": [{"role",
"content"}, ...]}, or synthetic:reverse|upper|sort|capitalize[:N] (a + between tasks mixes them).
Loss is on the assistant replies only; bad lines are counted and listed with FILE:LINE, never fatal. Start from a base with
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
