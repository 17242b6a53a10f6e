"""``python -m maxlm.distill --config=distill_tiny.gin``: knowledge distillation through the shared loop.

The same command line as ``python -m maxlm.train`` (resume, --fresh, --run_dir, gin bindings),
for configs with TrainConfig.task = "distill": the run's ModelConfig is the student, and
DistillConfig.teacher names a trained teacher's run directory. See maxlm/posttrain/distill.py.
"""

import sys

EPILOG = """examples:
  python -m maxlm.train --config=tiny.gin                     # the teacher distill_tiny.gin expects (runs/tiny)
  python -m maxlm.distill --config=distill_tiny.gin
  python -m maxlm.distill --config=distill_tiny.gin --run_dir=runs/distill_t1 \\
      --gin_bindings="DistillConfig.temperature=1.0" --gin_bindings="DistillConfig.alpha=0.9"
  python -m maxlm.distill --config=distill_tiny.gin --gin_bindings="DistillConfig.teacher_logits='runs/tiny_logits'"
  # two stages: hidden states first (student layer:teacher layer), then logits from stage 1's student
  python -m maxlm.distill --config=distill_tiny.gin --run_dir=runs/stage1 \\
      --gin_bindings="DistillConfig.feature_layers='1:2,2:4'" --gin_bindings="DistillConfig.feature_weight=0.1"
  python -m maxlm.distill --config=distill_tiny.gin --run_dir=runs/stage2 \\
      --gin_bindings="TrainConfig.init_from='runs/stage1'"

loss = logit_weight * (alpha T^2 KL(teacher_T || student_T) + (1 - alpha) CE) + feature_weight * F,
on DataConfig's data. DistillConfig.teacher: a run directory (its newest good checkpoint) or
RUN_DIR/checkpoints/STEP; its config.gin gives the teacher's model, which must share the student's
tokenizer and vocabulary. teacher_logits = 'online' runs the teacher in every step; a directory
caches its top_k log-probs per token there (filled on first use, refused if made for another
teacher or data). Rerunning with the same --run_dir resumes. The run ends by printing the
student's and the teacher's held-out cross-entropy."""


def main(argv=None) -> int:
    if argv is None:
        from maxlm.train import allocator
        allocator.use_huge_pages()  # before jax is imported: the process may re-execute itself
    from maxlm.posttrain import build_task
    from maxlm.train.pretrain import main as train_main

    return train_main(argv, build_task=build_task, name="maxlm.distill", task="distill", epilog=EPILOG,
                      default_config="distill_tiny.gin", description=__doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
